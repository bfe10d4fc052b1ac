"""Multi-turn rollouts through `cohort serve` on kept sessions: each later turn sends only its new tokens.

`RemoteEngine.generate_turns` uses this when the server's /health says `"sessions": true` (cohort's engine),
else it re-sends the conversation at every turn (cohort.engine.turns_by_regeneration). Every conversation
(prompt i, sample j) is one server session, seeded seed + i * n + j as the in-process engine's
`generate_turns` seeds it, so the tokens equal the in-process engine's; every round of turns is one request.
A conversation whose callback returns None is closed at once (its KV freed); all of this rollout's sessions
are closed at the end, also on an error. A session the server no longer holds (410 `session_evicted`: its
timeout, --max-sessions, a restart) is re-opened with the whole conversation so far as its prompt (one
re-prefill, seeded as the re-send path seeds that turn).
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cohort.errors import CohortError
from cohort.remote.errors import ServerUnavailable, SessionGone, StaleServer
from cohort.types import Completion, FinishReason, SamplingParams, TurnCallback, TurnEnd


@dataclass
class _Conv:
    index: int
    sample: int
    sid: str
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    finish_reason: FinishReason = "length"
    version: int | None = None
    offset: int = 0  # completion tokens inside the server session's prompt (non-zero after a re-open)
    base_turns: int = 0  # the turns among them
    new: list[int] = field(default_factory=list)  # context tokens sent with the next turn

    def take(self, answer: dict, version: int) -> None:
        """The server's completion of this session so far, after the `offset` tokens of its prompt."""
        cut = self.offset
        self.ids = self.ids[:cut] + answer["token_ids"]
        self.logprobs = self.logprobs[:cut] + answer["logprobs"]
        self.mask = self.mask[:cut] + answer["mask"]
        self.turns = self.base_turns + answer["turns"]
        self.finish_reason = answer["finish_reason"]
        self.version = version if self.version is None else min(self.version, version)

    def turn_end(self) -> TurnEnd:
        start = max((k + 1 for k, m in enumerate(self.mask) if m == 0), default=0)
        return TurnEnd(prompt_index=self.index, sample_index=self.sample, prompt_ids=self.prompt,
                       completion_ids=list(self.ids), turn_ids=self.ids[start:], turn=self.turns,
                       finish_reason=self.finish_reason)


def generate_turns_in_sessions(remote: Any, prompts: Sequence[Sequence[int]], params: SamplingParams,
                               on_turn_end: TurnCallback) -> list[list[Completion]]:
    """CohortEngine.generate_turns' contract over a session-keeping server (see the module docstring)."""
    owner = uuid.uuid4().hex
    convs = [_Conv(i, j, f"{owner}-{i}-{j}", list(p)) for i, p in enumerate(prompts) for j in range(params.n)]
    each = [_one(params, c.index * params.n + c.sample) for c in convs]
    try:
        _round(remote, owner, convs, [c.prompt for c in convs], each, cont=False)
        live = [c for c in convs if c.finish_reason == "stop"]
        while live:
            pending = [on_turn_end(c.turn_end()) for c in live]
            replies = [r.result() if isinstance(r, Future) else r for r in pending]
            ended = [c.sid for c, r in zip(live, replies, strict=True) if not r]
            if ended:
                remote.client.request("POST", "/sessions/close", {"session_ids": ended}, phase="close sessions")
            live = [c for c, r in zip(live, replies, strict=True) if r]
            for conv, tokens in zip(live, [r for r in replies if r], strict=True):
                if len(tokens) >= params.max_tokens - len(conv.ids):
                    raise ValueError(f"a continuation of {len(tokens)} tokens leaves no room to generate: the "
                                     f"completion has {len(conv.ids)} of max_tokens={params.max_tokens}; end the "
                                     "conversation (return None) when the context does not fit.")
                conv.new = list(tokens)
            if live:
                _continue_round(remote, owner, live, params)
            live = [c for c in live if c.finish_reason == "stop"]
    finally:
        # a server that is gone holds no sessions; the rollout's own error (if any) is the one to see
        with contextlib.suppress(CohortError):
            remote.client.request("POST", "/sessions/close", {"owner": owner}, phase="close sessions")
    return [[Completion(c.ids, c.logprobs, c.finish_reason, mask=c.mask, turns=c.turns, version=c.version)
             for c in convs[i * params.n:(i + 1) * params.n]] for i in range(len(prompts))]


def _one(params: SamplingParams, row: int) -> SamplingParams:
    return dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + row)


def _wire(params: SamplingParams) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()}


def _round(remote: Any, owner: str, convs: list[_Conv], prompts: list[list[int]], params: list[SamplingParams],
           *, cont: bool) -> None:
    body = {"prompts": prompts, "params": [_wire(p) for p in params], "session_id": [c.sid for c in convs],
            "keep": True, "continue": cont, "owner": owner, **remote.version_fields()}
    phase = "generate (session turn)"
    for attempt in (0, 1):  # a restarted server: re-push (RemoteEngine._recover), then this round once more
        try:
            out = remote.client.request("POST", "/generate", body, phase=phase)
        except (ServerUnavailable, StaleServer) as exc:
            if attempt:
                raise
            remote._recover(phase, exc)
            continue
        if out.get("server_id") == remote.server_id or not remote.pusher or attempt:
            break
        # sampled with weights we never pushed (a continued round there is refused first: 410, re-opened)
        remote._recover(phase, StaleServer("restarted", out.get("server_id")))
    for conv, group in zip(convs, out["completions"], strict=True):
        conv.take(group[0], out["version"])


def _continue_round(remote: Any, owner: str, live: list[_Conv], params: SamplingParams) -> None:
    """Send each conversation's new tokens on its session; if the server lost one, re-open every session of
    the round with its whole conversation as the prompt (seeded as turns_by_regeneration seeds a turn)."""
    try:
        _round(remote, owner, live, [c.new for c in live], [_one(params, 0)] * len(live), cont=True)
        return
    except SessionGone:
        pass
    for conv in live:
        conv.base_turns = conv.turns
        conv.ids, conv.logprobs = conv.ids + conv.new, conv.logprobs + [0.0] * len(conv.new)
        conv.mask, conv.offset = conv.mask + [0] * len(conv.new), len(conv.ids)
    seeds = [None if params.seed is None else params.seed + c.index * params.n + c.sample + 7919 * c.turns
             for c in live]
    _round(remote, owner, live, [c.prompt + c.ids for c in live],
           [dataclasses.replace(params, n=1, max_tokens=params.max_tokens - len(c.ids), seed=seed)
            for c, seed in zip(live, seeds, strict=True)], cont=False)

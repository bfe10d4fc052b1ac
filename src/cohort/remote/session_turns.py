"""Multi-turn rollouts through `cohort serve` on kept sessions, continuous: each conversation's next turn is
sent the moment its own tool result is ready, and only its new tokens are sent.

`RemoteEngine.generate_turns` uses this when the server's /health says `"sessions": true` (cohort's engine),
else it re-sends the conversation at every turn (cohort.engine.turns_by_regeneration). Every conversation
(prompt i, sample j) is one server session, seeded seed + i * n + j as the in-process engine's
`generate_turns` seeds it, so the tokens equal the in-process engine's. Where the server opens groups (/health
"session_groups"), a prompt's n conversations are opened together, on one prefill of the prompt whose KV
blocks they share, as in process (else each conversation prefills its own copy: n times the prompt tokens).

Why this shape: sending a round of turns as one request and waiting for its answer makes every conversation
wait for the slowest turn of the round (and the round's tools), where in process a conversation continues on
its kept KV as soon as its own tool returns. One blocking request per conversation would fix that but hold one
of the server's HTTP workers (--http-workers, 64) per conversation in flight, capping the engine batch and
starving other clients (/health, other ranks). So the turns are sent `detach`ed (the request answers once
they are queued) and the server decodes every session turn in flight as one continuous batch
(serving/session_driver.py); one poller thread per rollout long-polls POST /sessions/wait, which answers
each turn as soon as it ends. The calling thread runs `on_turn_end` on each ended turn (as the in-process
engine does, between engine steps); a reply that is ready, or a Future once done, is sent at once, together
with whatever else is ready at that moment (one request). Every wait is bounded: each request has the
client's timeout, the poll waits at most POLL_S on the server, and a poll that fails reaches the caller.

A conversation whose callback returns None is closed at once (its KV freed), by a thread of its own (_Closer),
after the next turns that were ready with it were sent: a close returns once the engine has released the
blocks, and the turns of the other conversations must not wait for that; all of this rollout's sessions
are closed at the end, also on an error (the server waits for turns in flight of closed sessions, then frees
them). A session the server no longer holds (410 `session_evicted`: its timeout, --max-sessions, a restart)
is re-opened, under a new session id, with the whole conversation so far as its prompt (one re-prefill,
seeded as the re-send path seeds that turn); after a server restart (a new server_id) the turns that were in
flight on the old server are re-sent the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cohort.errors import CohortError
from cohort.remote.errors import ServerError, ServerUnavailable, SessionGone, StaleServer
from cohort.types import Completion, FinishReason, SamplingParams, TurnCallback, TurnEnd

POLL_S = 5.0  # the longest one /sessions/wait waits on the server for a turn to end (at most the timeout / 2)
_PHASE = "generate (session turn)"


@dataclass
class _Conv:
    index: int
    sample: int
    prompt: list[int]
    sid: str = ""
    opens: int = 0  # sessions opened for it (a re-open takes a new id)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0
    finish_reason: FinishReason = "length"
    version: int | None = None
    offset: int = 0  # completion tokens inside the server session's prompt (non-zero after a re-open)
    base_turns: int = 0  # the turns among them
    new: list[int] = field(default_factory=list)  # context tokens sent with the next turn
    server: str | None = None  # the server its turn in flight was sent to
    sent: tuple | None = None  # that turn: ("open", prompt, params) or ("continue",)

    def take(self, answer: dict) -> None:
        """The server's completion of this session so far, after the `offset` tokens of its prompt."""
        cut = self.offset
        self.ids = self.ids[:cut] + answer["token_ids"]
        self.logprobs = self.logprobs[:cut] + answer["logprobs"]
        self.mask = self.mask[:cut] + answer["mask"]
        self.turns = self.base_turns + answer["turns"]
        self.finish_reason = answer["finish_reason"]
        version = answer["version"]
        self.version = version if self.version is None else min(self.version, version)

    def turn_end(self) -> TurnEnd:
        start = max((k + 1 for k, m in enumerate(self.mask) if m == 0), default=0)
        return TurnEnd(prompt_index=self.index, sample_index=self.sample, prompt_ids=self.prompt,
                       completion_ids=list(self.ids), turn_ids=self.ids[start:], turn=self.turns,
                       finish_reason=self.finish_reason)


def generate_turns_in_sessions(remote: Any, prompts: Sequence[Sequence[int]], params: SamplingParams,
                               on_turn_end: TurnCallback) -> list[list[Completion]]:
    """CohortEngine.generate_turns' contract over a session-keeping server (see the module docstring)."""
    rollout = _Rollout(remote, params, on_turn_end)
    convs = [_Conv(i, j, list(p)) for i, p in enumerate(prompts) for j in range(params.n)]
    try:
        rollout.run(convs)
    finally:
        rollout.finish()
    return [[Completion(c.ids, c.logprobs, c.finish_reason, mask=c.mask, turns=c.turns, version=c.version)
             for c in convs[i * params.n:(i + 1) * params.n]] for i in range(len(prompts))]


def _seed(params: SamplingParams, row: int) -> int | None:
    return None if params.seed is None else params.seed + row


def _one(params: SamplingParams, row: int) -> SamplingParams:
    return dataclasses.replace(params, n=1, seed=_seed(params, row))


def _wire(params: SamplingParams) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()}


class _Rollout:
    """One generate_turns call: its owner id, the conversations in flight (by session id), the events the
    poller and the tools' Futures report (a queue the calling thread reads)."""

    def __init__(self, remote: Any, params: SamplingParams, on_turn_end: TurnCallback) -> None:
        self.remote, self.params, self.on_turn_end = remote, params, on_turn_end
        self.owner = uuid.uuid4().hex
        self.events: queue.Queue[tuple] = queue.Queue()
        self.flying: dict[str, _Conv] = {}  # sent, not answered yet
        self.tools: dict[Future, _Conv] = {}  # replies not ready yet
        self.stop = threading.Event()
        self.poller: threading.Thread | None = None
        self.poll_s = max(0.05, min(POLL_S, remote.client.timeout_s / 2))
        self.closer = _Closer(self)

    # ---- the loop ---------------------------------------------------------------------------------------
    def run(self, convs: list[_Conv]) -> None:
        n = self.params.n
        singles = [_one(self.params, c.index * n + c.sample) for c in convs]
        for c, p in zip(convs, singles):  # how a re-open sends its first turn again: alone, seeded as in its group
            c.sent = ("open", c.prompt, p)
        if self.remote.session_groups:  # each prompt once, its n sessions on one prefill (as in process)
            firsts = convs[::n]
            self._open(convs, [c.prompt for c in firsts],
                       [dataclasses.replace(self.params, seed=_seed(self.params, c.index * n)) for c in firsts])
        else:
            self._open(convs, [c.prompt for c in convs], singles)
        self._start_poller()
        while self.flying or self.tools:
            ready: list[_Conv] = []
            ended: list[str] = []
            for event in self._next_events():
                kind = event[0]
                if kind == "turns":
                    self._on_turns(event[1], ready, ended)
                elif kind == "reply":
                    self.tools.pop(event[2], None)
                    self._route(event[1], event[2].result(), ready, ended)
                elif kind == "close error":
                    raise event[1]
                else:
                    self._on_poll_error(event[1], event[2])
            if ready:  # first: the engine waits for them, nothing waits for a close
                self._continue(ready)
            if ended:
                self.closer.close(ended)
            lost = [c for c in self.flying.values() if c.server != self.remote.server_id]
            if lost:  # sent to a server that is gone (a restart): their turns are sent again
                self._reopen(lost)

    def _next_events(self) -> list[tuple]:
        """The next event (waiting for one) and every other one already there."""
        while True:
            try:
                events = [self.events.get(timeout=1.0)]
                break
            except queue.Empty:
                if self.flying and (self.poller is None or not self.poller.is_alive()) and self.events.empty():
                    raise CohortError("the session poller stopped without a word") from None
        while True:
            try:
                events.append(self.events.get_nowait())
            except queue.Empty:
                return events

    def _on_turns(self, answer: dict, ready: list[_Conv], ended: list[str]) -> None:
        evicted = []
        for entry in answer["turns"]:
            conv = self.flying.get(entry["session_id"])
            if conv is None or conv.server != answer["server_id"]:
                continue  # a turn this rollout no longer waits for (re-sent meanwhile)
            del self.flying[conv.sid]
            error = entry.get("error")
            if error is not None:
                if error.get("type") != "session_evicted":
                    raise ServerError(f"{self.remote.client.where} failed a session turn: {error.get('message')}")
                evicted.append(conv)
                continue
            conv.take(entry)
            if conv.finish_reason == "stop":
                self._route(conv, self.on_turn_end(conv.turn_end()), ready, ended)
        if evicted:
            self._reopen(evicted)

    def _route(self, conv: _Conv, reply: Any, ready: list[_Conv], ended: list[str]) -> None:
        """The callback's reply: a Future is waited for by the queue; tokens continue the conversation; None
        ends it."""
        if isinstance(reply, Future):
            self.tools[reply] = conv
            reply.add_done_callback(lambda f: self.events.put(("reply", conv, f)))
            return
        if not reply:
            ended.append(conv.sid)
            return
        if len(reply) >= self.params.max_tokens - len(conv.ids):
            raise ValueError(f"a continuation of {len(reply)} tokens leaves no room to generate: the completion "
                             f"has {len(conv.ids)} of max_tokens={self.params.max_tokens}; end the "
                             "conversation (return None) when the context does not fit.")
        conv.new = list(reply)
        ready.append(conv)

    # ---- sending turns ------------------------------------------------------------------------------------
    def _open(self, convs: list[_Conv], prompts: list[list[int]], params: list[SamplingParams]) -> None:
        """Open a new session for each conversation (its first turn, or a re-open): prompt k with params[k].n
        opens the next n conversations' sessions."""
        for conv in convs:
            conv.opens += 1
            conv.sid = f"{self.owner}-{conv.index}-{conv.sample}" + (f"-{conv.opens}" if conv.opens > 1 else "")
        self._send(convs, prompts, params, cont=False)

    def _continue(self, convs: list[_Conv]) -> None:
        for conv in convs:
            conv.sent = ("continue",)
        try:
            self._send(convs, [c.new for c in convs], [_one(self.params, 0)] * len(convs), cont=True)
        except SessionGone:  # the request is refused as a whole: each conversation re-opened
            self._reopen(convs)

    def _reopen(self, convs: list[_Conv]) -> None:
        """Send again the turn of each conversation that the server lost: an open as it was; a continued turn as
        an open of the whole conversation so far (seeded as turns_by_regeneration seeds a turn)."""
        for conv in convs:
            self.flying.pop(conv.sid, None)
        old = [c.sid for c in convs]
        prompts, params = [], []
        for conv in convs:
            if conv.sent is not None and conv.sent[0] == "open":
                prompts.append(conv.sent[1])
                params.append(conv.sent[2])
                continue
            conv.base_turns = conv.turns
            conv.ids, conv.logprobs = conv.ids + conv.new, conv.logprobs + [0.0] * len(conv.new)
            conv.mask, conv.offset = conv.mask + [0] * len(conv.new), len(conv.ids)
            seed = self.params.seed
            seed = None if seed is None else seed + conv.index * self.params.n + conv.sample + 7919 * conv.turns
            prompts.append(conv.prompt + conv.ids)
            params.append(dataclasses.replace(self.params, n=1, max_tokens=self.params.max_tokens - len(conv.ids),
                                              seed=seed))
            conv.sent = ("open", prompts[-1], params[-1])
        # the old sessions, where the server still holds them (a refused continue), are freed now
        with contextlib.suppress(CohortError):
            self._request("/sessions/close", {"session_ids": old}, "close sessions")
        self._open(convs, prompts, params)

    def _send(self, convs: list[_Conv], prompts: list[list[int]], params: list[SamplingParams], *,
              cont: bool) -> None:
        """One detached /generate of these turns (queued on the server, answered by /sessions/wait)."""
        body = {"prompts": prompts, "params": [_wire(p) for p in params], "session_id": [c.sid for c in convs],
                "keep": True, "continue": cont, "detach": True, "owner": self.owner,
                **self.remote.version_fields()}
        for attempt in (0, 1):  # a restarted server: re-push (RemoteEngine._recover), then this request once more
            try:
                out = self.remote.client.request("POST", "/generate", body, phase=_PHASE)
                break
            except (ServerUnavailable, StaleServer) as exc:
                if attempt:
                    raise
                self.remote._recover(_PHASE, exc)
        server = out["server_id"]
        if server != self.remote.server_id and self.remote.pusher:
            # queued on a server with weights we never pushed: re-push; the turns are sent again (run's `lost`)
            self.remote._recover(_PHASE, StaleServer("restarted", server))
            server = None
        for conv in convs:
            conv.server = server
            self.flying[conv.sid] = conv

    def _request(self, path: str, body: dict, phase: str) -> dict:
        return self.remote.client.request("POST", path, body, phase=phase)

    # ---- the poller -------------------------------------------------------------------------------------
    def _start_poller(self) -> None:
        self.poller = threading.Thread(target=self._poll, name="cohort-session-wait", daemon=True)
        self.poller.start()

    def _poll(self) -> None:
        """Long-poll /sessions/wait until stopped; an error ends this poller (the calling thread decides)."""
        while not self.stop.is_set():
            server = self.remote.server_id
            try:
                out = self._request("/sessions/wait", {"owner": self.owner, "timeout_s": self.poll_s},
                                    "wait for session turns")
            except CohortError as exc:
                self.events.put(("error", exc, server))
                return
            if out["turns"]:
                self.events.put(("turns", out))

    def _on_poll_error(self, error: CohortError, server: str) -> None:
        """A failed poll: a server that restarted is recovered from (the trainer re-pushes; run's `lost`
        re-sends the turns that were in flight there); any other error is the rollout's."""
        if server == self.remote.server_id:  # else the server changed since: that poll's error is stale
            if not isinstance(error, (ServerUnavailable, StaleServer)):
                raise error
            self.remote._recover("wait for session turns", error)  # raises unless the server restarted
        self._start_poller()

    def finish(self) -> None:
        """Stop the poller, cancel the tools not started, and close every session of this rollout (a server that
        is gone holds none: the rollout's own error, if any, is the one to see)."""
        self.stop.set()
        for future in self.tools:
            future.cancel()
        self.closer.stop()  # the owner's close below ends whatever it had not closed yet
        with contextlib.suppress(CohortError):
            self._request("/sessions/close", {"owner": self.owner}, "close sessions")
        if self.poller is not None:  # its wait returns at the close; a server that is gone fails it (a daemon)
            self.poller.join(1.0)


class _Closer:
    """Closes ended conversations' sessions from its own thread: a close waits on the server until the blocks
    are back in the pool (up to an engine step), and the rollout's thread has the other conversations' next
    turns to send meanwhile. Ids that end while a close is under way go out together in the next one. A
    server that is gone or restarted holds none of them (the poller reports it); any other refusal is the
    rollout's error."""

    def __init__(self, rollout: _Rollout) -> None:
        self.rollout = rollout
        self.ids: list[str] = []
        self.cond = threading.Condition()
        self.stopped = False
        self.thread: threading.Thread | None = None

    def close(self, ids: list[str]) -> None:
        with self.cond:
            self.ids += ids
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="cohort-session-close", daemon=True)
                self.thread.start()
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if self.thread is not None:  # a close under way ends within its request's timeout (a daemon)
            self.thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.ids or self.stopped)
                if self.stopped:
                    return
                ids, self.ids = self.ids, []
            try:
                self.rollout._request("/sessions/close", {"session_ids": ids}, "close sessions")
            except (ServerUnavailable, StaleServer):
                continue
            except CohortError as exc:
                self.rollout.events.put(("close error", exc))
                return

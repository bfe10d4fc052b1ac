"""Served conversations that keep their KV between turns: `session_id` on POST /generate.

A multi-turn rollout through `cohort serve` otherwise re-sends and prefills the whole conversation at every
turn. With a session, the first request sends the prompt (`session_id`, `keep: true`); the engine's sequence
ends its turn PAUSED with its KV blocks kept (the in-process `generate_turns` mechanism), and the next request
with the same id and `continue: true` sends only the new tokens (tool result, next assistant header): the
engine appends them to the kept sequence and prefills only them. A session ends on `keep: false`, when its
sequence finishes (length), on POST /sessions/close, when unused for `--session-timeout-s` (a client that died
never comes back; a live one with a slow tool sends POST /sessions/keepalive), and under `--max-sessions`
(the least recently used first). A `continue` on an id that ended that way is refused by name (410,
`session_evicted`): the client re-sends the whole conversation. Sessions live on the first replica (its
engine holds the blocks); every call into an engine runs under that replica's lock (engines are not
thread-safe).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cohort.engine.sequence import Sequence, Status
from cohort.errors import CohortError
from cohort.types import Completion, SamplingParams

MAX_ID_CHARS = 128  # a session id is a client-chosen key held in memory: bounded
_REMEMBERED = 4096  # ended ids remembered, so that a late `continue` gets the named error, not "unknown"


class SessionEvicted(CohortError):
    """A `continue` on a session the server no longer holds (timeout, cap, close, or a restart)."""


@dataclass(frozen=True)
class SessionRequest:
    """The session fields of one POST /generate: one id per prompt."""

    ids: list[str]
    keep: bool
    cont: bool
    owner: str | None


def parse(body: dict, check_id: Callable[[Any, str], str]) -> SessionRequest | None:
    """Pop the session fields from a /generate body (the rest goes to limits.generate_request); None when the
    request names no session. `check_id` validates a client string (limits.session's rules)."""
    raw = body.pop("session_id", None)
    keep, cont, owner = body.pop("keep", False), body.pop("continue", False), body.pop("owner", None)
    if raw is None:
        if keep or cont:
            raise ValueError("`keep` / `continue` need a `session_id`")
        return None
    ids = [raw] if isinstance(raw, str) else raw
    if not isinstance(ids, list) or not ids:
        raise ValueError("session_id must be a string or a non-empty list of strings (one per prompt)")
    ids = [check_id(i, "session_id") for i in ids]
    if any(len(i) > MAX_ID_CHARS or not i for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"session ids must be distinct, non-empty and at most {MAX_ID_CHARS} characters")
    if not isinstance(keep, bool) or not isinstance(cont, bool):
        raise ValueError("`keep` and `continue` must be true or false")
    return SessionRequest(ids, keep, cont, None if owner is None else check_id(owner, "owner"))


@dataclass
class _Session:
    seq: Sequence
    owner: str | None
    used: float


def check_options(timeout_s: float, cap: int) -> None:
    """`cohort serve`'s session flags, checked before any model loads."""
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise CohortError(f"--session-timeout-s={timeout_s} must be a finite number of seconds > 0, e.g. 300")
    if cap < 1:
        raise CohortError(f"--max-sessions={cap} must be >= 1, e.g. 64 (each kept conversation holds its KV)")


class SessionTable:
    """The sessions of one engine (the first replica's), their timeout and cap."""

    def __init__(self, engine: Any, lock: threading.Lock, *, timeout_s: float = 300.0, cap: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_options(timeout_s, cap)
        self.engine, self.lock, self.timeout_s, self.cap, self.clock = engine, lock, timeout_s, cap, clock
        self._live: OrderedDict[str, _Session] = OrderedDict()  # least recently used first
        self._ended: deque[str] = deque(maxlen=_REMEMBERED)

    def __len__(self) -> int:
        return len(self._live)

    def turn(self, req: SessionRequest, prompts: list[list[int]], params: list[SamplingParams],
             version: int) -> tuple[list[Completion], list[bool]]:
        """One turn of every session of the request, in one batch: new sessions prefill their prompt,
        continued ones only their new tokens. Returns each conversation's completion so far (mask, turns) and
        whether it is still kept. `version` (the one this request holds) is the client's to record: it keeps
        each conversation's oldest."""
        if len(req.ids) != len(prompts) or any(p.n != 1 for p in params):
            raise ValueError("a session request gives one session_id per prompt, each with n=1")
        with self.lock:
            self.sweep()
            if req.cont:  # every session checked before any resumes: a refused request changes nothing
                kept_seqs = [self._kept(sid, len(tokens)) for sid, tokens in zip(req.ids, prompts, strict=True)]
                for seq, tokens in zip(kept_seqs, prompts, strict=True):
                    self.engine.scheduler.resume(seq, list(tokens))
                seqs = kept_seqs
            else:
                for sid in req.ids:  # a fresh start under a live id (a client that re-sends) frees the old one
                    if sid in self._live:
                        self._free(sid, self._live.pop(sid).seq)
                self.engine.runner.ensure_kv_cache()
                # index 0 for every session: its seed is params.seed, as one prompt of an in-process engine
                seqs = [self.engine._add(0, tokens, p, multi_turn=True)[0] for tokens, p in zip(prompts, params)]
            self._drive()
            out, kept = [], []
            for sid, seq in zip(req.ids, seqs, strict=True):
                out.append(Completion(seq.completion_ids, list(seq.logprobs), seq.finish_reason or "length",
                                      mask=list(seq.mask), turns=seq.turns))
                keep = req.keep and seq.status is Status.PAUSED
                self._live.pop(sid, None)  # re-inserted last: the most recently used
                if keep:
                    self._live[sid] = _Session(seq, req.owner, self.clock())
                else:
                    self._free(sid, seq)
                kept.append(keep)
            self._enforce_cap()
        return out, kept

    def _kept(self, sid: str, new_tokens: int) -> Sequence:
        """The kept sequence of `sid`, with room for `new_tokens` more context and one sampled token."""
        session = self._live.get(sid)
        if session is None or session.seq not in self.engine.scheduler.paused:
            self._live.pop(sid, None)
            why = "was ended (timeout, --max-sessions, close or an engine error)" if sid in self._ended or \
                session is not None else "is unknown to this server (restarted?)"
            raise SessionEvicted(f"session {sid!r} {why}; its KV is gone: re-send the whole conversation "
                                 "(prompt and every turn so far) without `continue`")
        seq = session.seq
        room = seq.max_tokens - seq.num_completion_tokens
        if new_tokens >= room:
            raise ValueError(f"session {sid!r}: a continuation of {new_tokens} tokens leaves no room to generate: "
                             f"the completion has {seq.num_completion_tokens} of max_tokens={seq.max_tokens}")
        return seq

    def _drive(self) -> None:
        try:
            while self.engine.scheduler.has_work():
                self.engine.step()
        except BaseException:
            self.engine._abort()  # the engine starts clean; every kept session is lost (named on its next turn)
            self._ended.extend(self._live)
            self._live.clear()
            raise

    def _free(self, sid: str, seq: Sequence) -> None:
        if seq.status is Status.PAUSED and seq in self.engine.scheduler.paused:
            self.engine.scheduler.release(seq)
        self._ended.append(sid)

    def _enforce_cap(self) -> None:
        while len(self._live) > self.cap:
            sid, session = self._live.popitem(last=False)
            self._free(sid, session.seq)

    def sweep(self) -> int:
        """Free the sessions unused for timeout_s (their clients died or gave up); caller holds `lock`."""
        now = self.clock()
        stale = [sid for sid, s in self._live.items() if now - s.used > self.timeout_s]
        for sid in stale:
            self._free(sid, self._live.pop(sid).seq)
        return len(stale)

    def close(self, ids: list[str] | None = None, owner: str | None = None) -> int:
        """End the named sessions and/or every session of `owner`; returns how many ended."""
        with self.lock:
            chosen = [sid for sid, s in self._live.items()
                      if (ids is not None and sid in ids) or (owner is not None and s.owner == owner)]
            for sid in chosen:
                self._free(sid, self._live.pop(sid).seq)
            return len(chosen)

    def keepalive(self, owner: str) -> int:
        """A live client (e.g. waiting on a slow tool) refreshes its sessions' timeout."""
        with self.lock:
            now, mine = self.clock(), [s for s in self._live.values() if s.owner == owner]
            for s in mine:
                s.used = now
            return len(mine)

    def reap_forever(self, stop: threading.Event) -> None:
        """The background sweep (a daemon thread of `cohort serve`): a dead client's sessions are freed within
        about a timeout and a quarter."""
        while not stop.wait(max(0.05, self.timeout_s / 4)):
            with self.lock:
                self.sweep()

    def info(self) -> dict:
        return {"sessions": True, "live_sessions": len(self._live), "max_sessions": self.cap,
                "session_timeout_s": self.timeout_s}


# ---- the HTTP side (server.py's routes call these) --------------------------------------------------------
def attach(server: Any, timeout_s: float, cap: int) -> SessionTable | None:
    """Give an EngineServer a session table (and its reaper thread) when its first engine can keep a sequence
    between calls (cohort's engine; Hugging Face generate cannot: clients then re-send, as before)."""
    replica = server.replicas[0]
    if not hasattr(getattr(replica.engine, "scheduler", None), "paused"):
        return None
    server.sessions = SessionTable(replica.engine, replica.lock, timeout_s=timeout_s, cap=cap)
    threading.Thread(target=server.sessions.reap_forever, args=(threading.Event(),), name="cohort-sessions",
                     daemon=True).start()
    return server.sessions


def generate_answer(server: Any, req: SessionRequest, prompts: list[list[int]],
                    params: SamplingParams | list[SamplingParams], keywords: dict) -> dict:
    """POST /generate with a session_id: one turn of each named session, under the server's read lock (one
    version per request, as every generation)."""
    table: SessionTable | None = server.sessions
    if table is None:
        raise ValueError("this server keeps no sessions (its engine is Hugging Face generate); re-send the "
                         "conversation without session_id")
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    (out, kept), version = server.generate(prompts, each, turn=lambda v: table.turn(req, prompts, each, v),
                                           **keywords)
    return {"version": version, "server_id": server.server_id, "kept": kept,
            "completions": [[{"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason,
                              "mask": c.mask, "turns": c.turns}] for c in out]}


def close_answer(server: Any, body: dict, check_id: Callable[[Any, str], str]) -> dict:
    """POST /sessions/close {"session_ids": [...]} and/or {"owner": ...}: end them now (their KV is freed)."""
    table: SessionTable | None = server.sessions
    ids, owner = body.get("session_ids"), body.get("owner")
    if ids is not None and (not isinstance(ids, list) or len(ids) > 1 << 16):
        raise ValueError("session_ids must be a list of session ids")
    ids = None if ids is None else [check_id(i, "session_ids") for i in ids]
    owner = None if owner is None else check_id(owner, "owner")
    return {"closed": 0 if table is None else table.close(ids, owner)}


def keepalive_answer(server: Any, body: dict, check_id: Callable[[Any, str], str]) -> dict:
    """POST /sessions/keepalive {"owner": ...}: the client is alive; its sessions' timeout starts again."""
    table: SessionTable | None = server.sessions
    owner = check_id(body.get("owner"), "owner")
    return {"sessions": 0 if table is None else table.keepalive(owner)}

"""Served conversations that keep their KV between turns: `session_id` on POST /generate.

A multi-turn rollout through `cohort serve` otherwise re-sends and prefills the whole conversation at every
turn. With a session, the first request sends the prompt (`session_id`, `keep: true`); the engine's sequence
ends its turn PAUSED with its KV blocks kept (the in-process `generate_turns` mechanism), and the next request
with the same id and `continue: true` sends only the new tokens (tool result, next assistant header): the
engine appends them to the kept sequence and prefills only them. A first turn's prompt with `n` > 1 opens n
sessions (`session_id` then lists one id per completion) on one prefill of that prompt, its KV blocks shared
as the in-process engine shares a prompt's among its samples (/health: "session_groups"; a client of a server
without it opens each conversation with its own copy of the prompt: n prefills of it). A session ends on
`keep: false`, when its sequence finishes (length), on POST /sessions/close, when unused for
`--session-timeout-s` (a client that died never comes back; a live one with a slow tool sends POST
/sessions/keepalive or waits on /sessions/wait), and under `--max-sessions` (the least recently used idle one
first). A `continue` on an id that ended that way
is refused by name (410, `session_evicted`): the client re-sends the whole conversation.

Every session turn in flight, from any request, decodes in one continuous engine batch (session_driver.py).
A request answers when its own turns have ended; with `detach: true` (and an `owner`) it answers at once
(`accepted`), and each of its turns is answered on its own, as soon as it ends, by POST /sessions/wait
{"owner", "timeout_s"}: a client sends a conversation's next turn the moment its tool result is ready,
whatever the other conversations do (remote/session_turns.py). Sessions live on the first replica (its engine
holds the blocks); every call into that engine runs under the replica's lock (engines are not thread-safe).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cohort.engine.sequence import Sequence, Status
from cohort.errors import CohortError
from cohort.serving import limits as L
from cohort.serving.session_driver import IDLE_WAIT_S, Batch, Driver, SessionEvicted, Turn
from cohort.types import SamplingParams

MAX_ID_CHARS = 128  # a session id is a client-chosen key held in memory: bounded
_REMEMBERED = 4096  # ended ids remembered, so that a late `continue` gets the named error, not "unknown"
CLOSE_WAIT_S = 60.0  # how long a close waits for the turns in flight of the sessions it ends


@dataclass(frozen=True)
class SessionRequest:
    """The session fields of one POST /generate: one id per prompt."""

    ids: list[str]
    keep: bool
    cont: bool
    owner: str | None
    detach: bool = False


def parse(body: dict, check_id: Callable[[Any, str], str]) -> SessionRequest | None:
    """Pop the session fields from a /generate body (the rest goes to limits.generate_request); None when the
    request names no session. `check_id` validates a client string (limits.session's rules)."""
    raw = body.pop("session_id", None)
    keep, cont, owner = body.pop("keep", False), body.pop("continue", False), body.pop("owner", None)
    detach = body.pop("detach", False)
    if raw is None:
        if keep or cont or detach:
            raise ValueError("`keep` / `continue` / `detach` need a `session_id`")
        return None
    ids = [raw] if isinstance(raw, str) else raw
    if not isinstance(ids, list) or not ids:
        raise ValueError("session_id must be a string or a non-empty list of strings (one per prompt)")
    ids = [check_id(i, "session_id") for i in ids]
    if any(len(i) > MAX_ID_CHARS or not i for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"session ids must be distinct, non-empty and at most {MAX_ID_CHARS} characters")
    for name, value in (("keep", keep), ("continue", cont), ("detach", detach)):
        L.flag(value, name)
    if detach and owner is None:
        raise L.RequestError("`detach: true` needs an `owner`: its turns are answered by POST /sessions/wait "
                             "{\"owner\": ...}", param="owner")
    return SessionRequest(ids, keep, cont, None if owner is None else check_id(owner, "owner"), detach)


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
    """The sessions of one engine (the first replica's): idle ones (kept between turns), busy ones (in a turn,
    driven by session_driver.Driver), their timeout and cap. `gate`: the EngineServer whose version lock
    and number the turns run under (set on the first request; None: version 0)."""

    def __init__(self, engine: Any, lock: threading.Lock, *, timeout_s: float = 300.0, cap: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check_options(timeout_s, cap)
        self.engine, self.lock, self.timeout_s, self.cap, self.clock = engine, lock, timeout_s, cap, clock
        self.cond = threading.Condition()  # this table's state; taken after `lock` when both are needed
        self.gate: Any = None
        self._live: OrderedDict[str, _Session] = OrderedDict()  # idle, least recently used first
        self._busy: dict[str, Turn] = {}  # in a turn (queued or in the engine)
        self._ended: deque[str] = deque(maxlen=_REMEMBERED)
        self.driver = Driver(self)

    def __len__(self) -> int:
        return len(self._live) + len(self._busy)

    # ---- turns --------------------------------------------------------------------------------------
    def submit(self, req: SessionRequest, prompts: list[list[int]], params: list[SamplingParams]) -> Batch:
        """Check every session of the request (a refused request changes nothing), then queue its turns for the
        driver: new sessions prefill their prompt, continued ones only their new tokens. A new prompt with
        n > 1 opens n sessions (the next n ids) on one prefill of it, as the in-process engine's group."""
        if req.cont and any(p.n != 1 for p in params):
            raise ValueError("a `continue` request gives one session_id per prompt, each with n=1")
        if len(req.ids) != sum(p.n for p in params):
            raise ValueError(f"a session request gives one session_id per completion: {len(req.ids)} ids for "
                             f"{sum(p.n for p in params)} (each prompt's n)")
        if not req.cont:
            for tokens, p in zip(prompts, params, strict=True):
                self.engine._validate(0, tokens, p)
        rows = [r for r, p in enumerate(params) for _ in range(p.n)]  # each session's prompt
        batch = Batch(detached=req.detach)
        with self.cond:
            busy = next((sid for sid in req.ids if sid in self._busy), None)
            if busy is not None:
                raise ValueError(f"session {busy!r} is in a turn already; send its next turn after this one ended")
            kept = [self._kept(sid, len(prompts[r])) if req.cont else None for sid, r in zip(req.ids, rows)]
            for k, (sid, r, seq) in enumerate(zip(req.ids, rows, kept, strict=True)):
                old = self._live.pop(sid, None)  # continued: now busy; a fresh start under a live id frees it
                if old is not None and seq is None:
                    batch.release.append(old.seq)
                first = k == 0 or rows[k - 1] != r  # a group's first session adds its n sequences
                turn = Turn(sid, req.owner, req.keep, prompts[r], params[r], seq, batch,
                            group=params[r].n if first else 0)
                batch.turns.append(turn)
                self._busy[sid] = turn
            self.driver.queue(batch)
        return batch

    def wait(self, batch: Batch) -> None:
        """Until every turn of `batch` has ended; raises the first error of its turns."""
        while not batch.done.wait(IDLE_WAIT_S):
            if not self.driver.alive():
                raise CohortError("the session turn driver stopped; this server cannot run session turns")
        if batch.error is not None:
            raise batch.error

    def _kept(self, sid: str, new_tokens: int) -> Sequence:
        """The kept sequence of `sid`, with room for `new_tokens` more context and one sampled token."""
        session = self._live.get(sid)
        if session is None or session.seq.status is not Status.PAUSED:
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

    # ---- called by the driver (replica lock and cond held) -------------------------------------------------
    def end_turn(self, turn: Turn, version: int) -> dict:
        """A turn's sequence ended it: keep the session (idle, most recently used) or free it; its answer."""
        seq = turn.seq
        assert seq is not None
        keep = turn.keep and seq.status is Status.PAUSED and not turn.closing
        self._busy.pop(turn.sid, None)
        if keep:
            self._live[turn.sid] = _Session(seq, turn.owner, self.clock())
        else:
            self._free(turn.sid, seq)
        return {"session_id": turn.sid, "token_ids": seq.completion_ids, "logprobs": list(seq.logprobs),
                "finish_reason": seq.finish_reason or "length", "mask": list(seq.mask), "turns": seq.turns,
                "kept": keep, "version": version}

    def unbusy(self, turn: Turn, *, kept: bool) -> None:
        """A turn that did not run (or was dropped): its session idle again (`kept`) or ended."""
        self._busy.pop(turn.sid, None)
        if kept and turn.seq is not None and not turn.closing:
            self._live[turn.sid] = _Session(turn.seq, turn.owner, self.clock())
        else:
            self._ended.append(turn.sid)

    def drop_all(self) -> None:
        """After the engine was reset (an engine error): every idle session is lost."""
        self._ended.extend(self._live)
        self._live.clear()

    def touch(self, owner: str) -> int:
        now, mine = self.clock(), [s for s in self._live.values() if s.owner == owner]
        for s in mine:
            s.used = now
        return len(mine)

    def _free(self, sid: str, seq: Sequence) -> None:
        self.release_kv(seq)
        self._ended.append(sid)

    def release_kv(self, seq: Sequence) -> None:
        """A session's blocks back to the pool (caller holds `lock`); one the engine dropped has none left."""
        if seq.status is Status.PAUSED and seq in self.engine.scheduler.paused:
            self.engine.scheduler.release(seq)

    def enforce_cap(self) -> None:
        while len(self._live) > self.cap:
            sid, session = self._live.popitem(last=False)
            self._free(sid, session.seq)

    # ---- ending sessions ------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Free the idle sessions unused for timeout_s (their clients died or gave up) and the answers nobody
        came for; caller holds `lock`."""
        with self.cond:
            now = self.clock()
            stale = [sid for sid, s in self._live.items() if now - s.used > self.timeout_s]
            for sid in stale:
                self._free(sid, self._live.pop(sid).seq)
            self.driver.sweep_mail(now, self.timeout_s)
            return len(stale)

    def close(self, ids: list[str] | None = None, owner: str | None = None) -> int:
        """End the named sessions and/or every session of `owner`; returns how many ended, once their blocks
        are back in the pool. One in a turn ends with it (its answer dropped): this waits for that, at most
        CLOSE_WAIT_S. The idle ones' blocks are released by the driver's thread before its next step (a close
        never queues for the replica's lock behind the driver)."""
        wanted = None if ids is None else set(ids)

        def chosen(sid: str, session_owner: str | None) -> bool:
            return (wanted is not None and sid in wanted) or (owner is not None and session_owner == owner)

        with self.cond:  # mark them (a turn in flight ends with its close), hand the idle ones over, wait
            idle = [(sid, self._live.pop(sid).seq) for sid, s in list(self._live.items()) if chosen(sid, s.owner)]
            busy = [t for t in self._busy.values() if chosen(t.sid, t.owner)]
            for turn in busy:
                turn.closing = True
            if owner is not None:
                self.driver.close_owner(owner)
            self._ended.extend(sid for sid, _ in idle)
            ticket = self.driver.hand_frees([seq for _, seq in idle])
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.driver.freed >= ticket and
                               not any(self._busy.get(t.sid) is t for t in busy), CLOSE_WAIT_S)
        return len(idle) + len(busy)

    def keepalive(self, owner: str) -> int:
        """A live client (e.g. waiting on a slow tool) refreshes its sessions' timeout."""
        with self.cond:
            return self.touch(owner)

    def reap_forever(self, stop: threading.Event) -> None:
        """The background sweep (a daemon thread of `cohort serve`): a dead client's sessions are freed within
        about a timeout and a quarter."""
        while not stop.wait(max(0.05, self.timeout_s / 4)):
            with self.lock:
                self.sweep()

    def info(self) -> dict:
        return {"sessions": True, "session_groups": True, "live_sessions": len(self), "max_sessions": self.cap,
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
    """POST /generate with a session_id: one turn of each named session, after the version check of every
    generation (`keywords`: min_version, wait_s, session). Detached: answered at once, each turn later by
    POST /sessions/wait; else when the request's last turn has ended, all of them sampled with one version."""
    table: SessionTable | None = server.sessions
    if table is None:
        raise ValueError("this server keeps no sessions (its engine is Hugging Face generate); re-send the "
                         "conversation without session_id")
    table.gate = server
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    server.wait_version(**keywords)
    batch = table.submit(req, prompts, each)
    if req.detach:
        return {"accepted": len(batch.turns), "server_id": server.server_id}
    table.wait(batch)
    answers = [t.answer or {} for t in batch.turns]
    fields = ("token_ids", "logprobs", "finish_reason", "mask", "turns")
    groups, start = [], 0  # one group per prompt: its n sessions' completions, in session_id order
    for p in each:
        groups.append([{k: a[k] for k in fields} for a in answers[start:start + p.n]])
        start += p.n
    return {"version": batch.version, "server_id": server.server_id, "kept": [a["kept"] for a in answers],
            "completions": groups}


def wait_answer(server: Any, body: dict, check_id: Callable[[Any, str], str], limits: L.Limits) -> dict:
    """POST /sessions/wait {"owner": ..., "timeout_s": s}: the answers of the owner's detached turns that ended
    since its last wait (each {"session_id", "token_ids", "logprobs", "finish_reason", "mask", "turns",
    "kept", "version"}, or {"session_id", "error": {"type", "message"}}), waiting up to timeout_s (at most
    limits.max_poll_s) for one. It also keeps the owner's idle sessions alive, as /sessions/keepalive."""
    unknown = sorted(set(body) - {"owner", "timeout_s"})
    if unknown:
        raise L.RequestError(f"unknown field(s) {unknown}; /sessions/wait takes ['owner', 'timeout_s']",
                             param=unknown[0])
    owner = check_id(body.get("owner"), "owner")
    timeout_s = L.wait_seconds(body.get("timeout_s"), dataclasses.replace(limits, max_wait_s=limits.max_poll_s),
                               "timeout_s")
    table: SessionTable | None = server.sessions
    turns = [] if table is None else table.driver.take_mail(owner, timeout_s)
    return {"turns": turns, "server_id": server.server_id}


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

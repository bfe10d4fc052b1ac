"""The continuous turn loop of served sessions: every session turn in flight decodes in one engine batch, and
each turn is answered as soon as its own sequence has ended it.

A session request (serving/sessions.py) is validated by the thread that received it and handed over as a
`Batch` of `Turn`s; one driver thread per session table (started on the first turn) admits waiting batches
into the engine between two engine steps (a continued turn resumes its kept sequence, a new one is added)
and steps the engine while any turn is in flight, as the in-process `generate_turns` loop does. After each
step the turns whose sequence paused (EOS / stop: its KV kept) or finished (length) are answered at once: a
request that waits (`Batch.done`) gets its batch's answers when the last of its turns has ended, a detached
request's turns go to their owner's mailbox, which POST /sessions/wait reads. A turn that ended never waits
for the other turns of its batch, nor for those of other requests.

Versions: the driver holds the server's read lock (EngineServer.hold_version) from the first admitted turn
until no turn is in flight, so every turn is sampled with one version (reported with its answer). When a
weight commit waits, no new batch is admitted: the turns in flight end, the driver lets the lock go, the
commit runs, and the waiting batches start under the new version.

Locks: the replica's lock (`table.lock`: the engine is not thread-safe) is taken per driver iteration (admit,
one step, collect), so other users of the engine (a plain /generate on the first replica, the sweep) get it
between two steps; the driver takes it back at once after each step and Python's lock is not fair, so such a
user may wait several steps. A close therefore never takes it: it hands the idle sessions' sequences to the
driver, which releases them before its next step (`frees`). The table's state (sessions, turns in flight,
mailboxes, frees) is under `table.cond`, always taken after the replica's lock when both are needed.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cohort.engine.sequence import Sequence, Status
from cohort.errors import CohortError
from cohort.types import SamplingParams

IDLE_WAIT_S = 1.0  # the driver's idle wait between two checks for work (it is woken by a submit anyway)
_CLOSED_KEPT = 4096  # closed owners remembered


class SessionEvicted(CohortError):
    """A `continue` on a session the server no longer holds (timeout, cap, close, or a restart)."""


@dataclass(eq=False)
class Turn:
    """One session's turn: `seq` is the kept sequence of a continued turn (set at admission for a new one)."""

    sid: str
    owner: str | None
    keep: bool
    tokens: list[int]
    params: SamplingParams
    seq: Sequence | None
    batch: Batch
    group: int = 1  # a new session: the sessions its prompt opens (itself and the next group - 1), 0 for those
    closing: bool = False  # its session was closed during the turn: freed when the turn ends, no answer kept
    answer: dict | None = None


@dataclass(eq=False)
class Batch:
    """The turns of one request, answered together (`done`) unless `detached` (each to its owner's mailbox)."""

    detached: bool
    turns: list[Turn] = field(default_factory=list)
    release: list[Sequence] = field(default_factory=list)  # sequences of sessions re-opened under a live id
    done: threading.Event = field(default_factory=threading.Event)
    left: int = 0
    version: int = 0
    error: BaseException | None = None


class Driver:
    """The admission queue, the turns in flight and the owners' mailboxes of one SessionTable."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self.pending: deque[Batch] = deque()
        self.flying: list[Turn] = []
        self.mail: dict[str, deque[tuple[float, dict]]] = {}  # owner -> (time, answer) of detached turns
        self.closed_owners: dict[str, None] = {}  # their waits return at once (the last _CLOSED_KEPT)
        # closed idle sessions' sequences, released by this thread before its next step: a close queued for the
        # replica's lock could wait several steps (this thread takes it back at once after each one)
        self.frees: list[Sequence] = []
        self.handed = self.freed = 0  # sequences ever handed over / released (a close waits for its ticket)
        self._thread: threading.Thread | None = None

    # ---- called under table.cond ----------------------------------------------------------------------
    def queue(self, batch: Batch) -> None:
        batch.left = len(batch.turns)
        self.pending.append(batch)
        self._start()

    def hand_frees(self, seqs: list[Sequence]) -> int:
        """Queue closed sessions' sequences for release; the ticket `freed` reaches once they are (0: none)."""
        if not seqs:
            return 0
        self.frees.extend(seqs)
        self.handed += len(seqs)
        self._start()
        return self.handed

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="cohort-session-turns", daemon=True)
            self._thread.start()
        self.table.cond.notify_all()

    def close_owner(self, owner: str) -> None:
        """Its answers not taken are dropped; its waits (now and later) return at once."""
        self.mail.pop(owner, None)
        self.closed_owners[owner] = None
        if len(self.closed_owners) > _CLOSED_KEPT:
            del self.closed_owners[next(iter(self.closed_owners))]
        self.table.cond.notify_all()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def answer(self, turn: Turn, answer: dict, version: int | None = None) -> None:
        """Record a turn's answer (its session is already kept or freed) and wake whoever waits for it."""
        turn.answer = answer
        batch = turn.batch
        if version is not None:
            batch.version = version
        if batch.detached and not turn.closing and turn.owner is not None:
            self.mail.setdefault(turn.owner, deque()).append((self.table.clock(), answer))
        batch.left -= 1
        if batch.left == 0:
            batch.done.set()
        self.table.cond.notify_all()

    def fail(self, turn: Turn, error: BaseException) -> None:
        turn.batch.error = turn.batch.error or error
        kind = "session_evicted" if isinstance(error, SessionEvicted) else "engine_error"
        self.answer(turn, {"session_id": turn.sid, "error": {"type": kind, "message": f"{error}"}})

    # ---- the driver thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.table.cond:
                while not self.pending and not self.frees:
                    self.table.cond.wait(IDLE_WAIT_S)
                turns = bool(self.pending)
            try:
                if turns:
                    self._period()
                else:  # only closes: no version to hold
                    with self.table.lock, self.table.cond:
                        self._release_frees()
            except BaseException as exc:  # never leave a waiting request without an answer
                with self.table.lock:
                    self._fail_all(exc, [])

    def _release_frees(self) -> None:
        """Release the closed sessions' sequences (caller holds the replica's lock and table.cond)."""
        for seq in self.frees:
            self.table.release_kv(seq)
        self.freed += len(self.frees)
        self.frees = []
        self.table.cond.notify_all()

    def _period(self) -> None:
        """Drive from the first admitted batch until no turn is in flight (or a commit waits), under one
        version."""
        gate = self.table.gate
        version = gate.hold_version() if gate is not None else 0
        try:
            while self._iterate(version, gate):
                pass
        finally:
            if gate is not None:
                gate.release_version()

    def _iterate(self, version: int, gate: Any) -> bool:
        """Admit what waits (unless a commit does), run one engine step, answer the turns that ended. False
        when the period is over."""
        engine = self.table.engine
        with self.table.lock:
            draining = gate is not None and gate.commit_waiting()  # checked once the engine is ours
            with self.table.cond:
                self._release_frees()
                batches = [] if draining else list(self.pending)
                if not draining:
                    self.pending.clear()
            try:
                for batch in batches:
                    self._admit(batch)
                if engine.scheduler.has_work():
                    engine.step()
                self._collect(version)
            except BaseException as exc:
                self._fail_all(exc, batches)
        with self.table.cond:
            return bool(self.flying) or (bool(self.pending) and not draining) or bool(self.frees)

    def _admit(self, batch: Batch) -> None:
        """Resume or add every turn of `batch`, or none: a kept sequence the engine dropped meanwhile (an
        engine error) fails the whole batch by name, its other sessions staying as they were."""
        scheduler = self.table.engine.scheduler
        for seq in batch.release:
            if seq.status is Status.PAUSED and seq in scheduler.paused:
                scheduler.release(seq)
        gone = [t for t in batch.turns if t.seq is not None and t.seq not in scheduler.paused]
        if gone:
            with self.table.cond:
                error = SessionEvicted(f"session {gone[0].sid!r} was ended (an engine error) before its turn "
                                       "started; its KV is gone: re-send the whole conversation without `continue`")
                for turn in batch.turns:
                    self.table.unbusy(turn, kept=turn.seq is not None and turn not in gone)
                    self.fail(turn, error)
            return
        fresh = [t for t in batch.turns if t.seq is None]
        if fresh:
            self.table.engine.runner.ensure_kv_cache()
        for turn in batch.turns:
            if turn.seq is not None:
                scheduler.resume(turn.seq, list(turn.tokens))
        for k, turn in enumerate(fresh):
            if turn.group:  # index 0: sample j's seed is params.seed + j, as one prompt of an in-process engine;
                # its n sequences share the prompt's one prefill and its KV blocks (forked), as in process
                seqs = self.table.engine._add(0, turn.tokens, turn.params, multi_turn=True)
                for member, seq in zip(fresh[k:k + turn.group], seqs, strict=True):
                    member.seq = seq
        with self.table.cond:
            self.flying.extend(batch.turns)

    def _collect(self, version: int) -> None:
        """Answer the turns whose sequence ended (paused or finished); a turn whose sequence left the engine
        otherwise (another request's engine error dropped it) is answered with session_evicted."""
        has_work = self.table.engine.scheduler.has_work()
        with self.table.cond:
            still = []
            for turn in self.flying:
                seq = turn.seq
                assert seq is not None
                if seq.status in (Status.PAUSED, Status.FINISHED):
                    self.answer(turn, self.table.end_turn(turn, version), version)
                elif not has_work:
                    self.table.unbusy(turn, kept=False)
                    self.fail(turn, SessionEvicted(f"session {turn.sid!r} was dropped by the engine (an engine "
                                                   "error); re-send the whole conversation without `continue`"))
                else:
                    still.append(turn)
            if len(still) != len(self.flying):
                self.table.enforce_cap()
            self.flying = still

    def _fail_all(self, exc: BaseException, batches: list[Batch]) -> None:
        """An engine error (caller holds the replica's lock): the engine starts clean; every turn in flight or
        being admitted (`batches`) is answered with the error and every kept session is lost (named on its
        next turn)."""
        self.table.engine._abort()
        with self.table.cond:
            self._release_frees()  # their blocks went with the abort: only counted as released
            admitting = [t for b in batches for t in b.turns if t.answer is None and t not in self.flying]
            for turn in self.flying + admitting:
                self.table.unbusy(turn, kept=False)
                self.fail(turn, exc)
            self.flying = []
            self.table.drop_all()

    # ---- mailboxes (POST /sessions/wait) ----------------------------------------------------------------
    def take_mail(self, owner: str, timeout_s: float) -> list[dict]:
        """The answers of `owner`'s detached turns that ended since its last wait, waiting up to `timeout_s`
        for one (at once when its sessions were closed)."""
        with self.table.cond:
            self.table.touch(owner)
            self.table.cond.wait_for(lambda: bool(self.mail.get(owner)) or owner in self.closed_owners, timeout_s)
            return [answer for _, answer in self.mail.pop(owner, ())]

    def sweep_mail(self, now: float, timeout_s: float) -> None:
        """Drop answers nobody came for within the session timeout (their client died); under table.cond."""
        for owner in [o for o, box in self.mail.items() if box and now - box[-1][0] > timeout_s]:
            del self.mail[owner]

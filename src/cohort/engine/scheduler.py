"""Continuous-batching scheduler: picks each step's work and preempts by recompute when blocks run out.

Every step is either a prefill step (new prompts or resumed sequences, packed without padding, at most
`max_num_batched_tokens` tokens) or a decode step (one token for each running sequence). Prefill goes first
so that new groups join the running batch as soon as there is room, as in nano-vllm.

Preemption by recompute: when a decode step needs a fresh block and none is free, the most recently
admitted sequence gives its blocks back and returns to the front of the queue with its generated tokens;
when admitted again it is prefilled from scratch (prompt + generated tokens) and continues where it left off.

Multi-turn: a sequence whose turn ended waits PAUSED, holding its blocks, until `resume` queues it with the
next turn's context tokens (a prefill of only those tokens) or `release` ends it. Paused sequences are the
first to give their blocks back when the cache runs out, and when nothing is running, queued continued turns
do too (evicted: the next turn is recomputed in full).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cohort.engine.block_manager import BlockManager
from cohort.engine.config import EngineConfig
from cohort.engine.sequence import PrefillUnit, Sequence, Status


@dataclass
class ScheduledStep:
    """One step's work. For prefill: `units` (leaders are computed, followers fork after the forward)."""

    is_prefill: bool
    seqs: list[Sequence]
    units: list[PrefillUnit] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # decode: steps this one may run on the device (engine.decode_steps); every sequence holds the blocks for
    # its decode_budget(lookahead) tokens. 1 when the cache could not give the blocks for more.
    lookahead: int = 1


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[PrefillUnit] = deque()
        self.running: deque[Sequence] = deque()
        self.paused: deque[Sequence] = deque()  # turn ended, blocks kept, waiting for the next turn's tokens
        self.num_preemptions = 0
        self.num_evictions = 0
        self.deferred_steps = 0  # decode steps the waiting continued turns have been held (continuation_delay_steps)

    def add(self, unit: PrefillUnit) -> None:
        self.waiting.append(unit)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int = 1) -> ScheduledStep:
        """The next step; a decode step may run `lookahead` device steps when the free blocks allow it."""
        if self.defers_continuations():
            decode = self._schedule_decode(lookahead)
            self.deferred_steps += decode.lookahead
            return decode
        step = self._schedule_prefill()
        if step is not None:
            self.deferred_steps = 0
            return step
        return self._schedule_decode(lookahead)

    def defers_continuations(self) -> bool:
        """Whether to decode rather than prefill this step: only continued turns wait, sequences are decoding,
        fewer than half as many turns wait as decode, and they have waited fewer than
        `continuation_delay_steps` decode steps (see EngineConfig)."""
        return (
            bool(self.waiting) and bool(self.running)
            and self.deferred_steps < (self.config.continuation_delay_steps or 0)
            and 2 * len(self.waiting) < len(self.running)
            and all(unit.leader.turns > 1 for unit in self.waiting)
        )

    def _schedule_prefill(self) -> ScheduledStep | None:
        units: list[PrefillUnit] = []
        num_tokens = 0
        num_seqs = len(self.running)
        copies: list[tuple[int, int]] = []
        while self.waiting:
            unit = self.waiting[0]
            need = self.blocks.blocks_for_unit(unit)
            # with nothing running, no block would come back by waiting: queued continued turns give theirs too
            while need > self.blocks.num_free_blocks and self._evict_idle(keep=unit.leader, queued=not self.running):
                need = self.blocks.blocks_for_unit(unit)
            if (
                num_seqs + len(unit.seqs) > self.config.max_num_seqs
                or num_tokens + unit.num_tokens > self.config.max_num_batched_tokens
                or need > self.blocks.num_free_blocks
            ):
                break
            self.waiting.popleft()
            self.blocks.allocate(unit.leader)
            copies += self.blocks.fork(unit.leader, unit.seqs[1:])
            for seq in unit.seqs:
                seq.status = Status.RUNNING
                self.running.append(seq)
            units.append(unit)
            num_tokens += unit.num_tokens
            num_seqs += len(unit.seqs)
        if not units:
            if self.waiting and not self.running:
                unit = self.waiting[0]
                raise RuntimeError(
                    f"a prompt of {unit.num_tokens} tokens with {len(unit.seqs)} samples does not fit the "
                    f"KV cache ({self.blocks.num_blocks} blocks of {self.blocks.block_size} tokens); raise "
                    "kv_cache_fraction / num_kv_blocks or lower max_model_len."
                )
            return None
        seqs = [seq for unit in units for seq in unit.seqs]
        return ScheduledStep(True, seqs, units, copies)

    def reserve_ahead(self, wanted: list[tuple[Sequence, int]]) -> bool:
        """Give each sequence the blocks for the KV of its first `tokens` positions, all or none (a chained
        multi-step launch); False when the free blocks do not cover them."""
        more = [(seq, self.blocks.blocks_for(tokens) - len(seq.block_table)) for seq, tokens in wanted]
        if sum(max(n, 0) for _, n in more) > self.blocks.num_free_blocks:
            return False
        for seq, n in more:
            for _ in range(n):
                self.blocks.append_block(seq)
        return True

    def _schedule_decode(self, lookahead: int = 1) -> ScheduledStep:
        # A chunk of `lookahead` steps writes KV at positions len-1 .. len+budget-2 of each sequence; when the
        # free blocks do not cover that, the step decodes one token (and may preempt, below).
        if lookahead > 1 and self.running and self.reserve_ahead(
                [(seq, len(seq) - 1 + seq.decode_budget(lookahead)) for seq in self.running]):
            return ScheduledStep(False, list(self.running), lookahead=lookahead)
        # Fast path (almost every step): the blocks that sequences crossing a boundary need are free.
        size = self.blocks.block_size
        needing = [s for s in self.running if (len(s.token_ids) - 1) // size >= len(s.block_table)]
        while len(needing) > self.blocks.num_free_blocks and self._evict_idle():
            pass
        if len(needing) <= self.blocks.num_free_blocks:
            for seq in needing:
                self.blocks.append_block(seq)
            return ScheduledStep(False, list(self.running))
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            preempted_self = False
            while self.blocks.needs_block_for_append(seq) and self.blocks.num_free_blocks == 0:
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    preempted_self = True
                    break
            if preempted_self:
                break
            if self.blocks.needs_block_for_append(seq):
                self.blocks.append_block(seq)
            scheduled.append(seq)
        self.running = deque(scheduled)
        return ScheduledStep(False, scheduled)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(PrefillUnit([seq]))

    def finish(self, seqs: list[Sequence]) -> list[Sequence]:
        """Drop sequences that just finished from the running set and return them. Their blocks go back to
        the pool, except a multi-turn sequence's that stopped (EOS / stop): it is PAUSED, blocks kept."""
        done = []
        for seq in seqs:
            if seq.finish_reason is not None and seq.status is Status.RUNNING:
                if seq.multi_turn and seq.finish_reason == "stop":
                    seq.status = Status.PAUSED
                    self.paused.append(seq)
                else:
                    seq.status = Status.FINISHED
                    self.blocks.free(seq)
                done.append(seq)
        if done:
            self.running = deque(s for s in self.running if s.status is Status.RUNNING)
        return done

    def resume(self, seq: Sequence, tokens: list[int]) -> None:
        """Continue a paused sequence with context tokens: only they (and the last sampled token, whose KV a
        finished turn never computed) are prefilled, unless it was evicted meanwhile (then all of it is)."""
        assert seq.status is Status.PAUSED, f"resume() on a {seq.status.value} sequence"
        self.paused.remove(seq)
        seq.num_cached = len(seq) - 1 if seq.block_table else 0
        seq.extend_context(tokens)
        seq.status = Status.WAITING
        self.waiting.append(PrefillUnit([seq]))

    def release(self, seq: Sequence) -> None:
        """End a paused sequence's conversation: its blocks go back to the pool."""
        if seq.status is Status.PAUSED:
            self.paused.remove(seq)
            self.blocks.free(seq)
            seq.status = Status.FINISHED

    def _evict_idle(self, keep: Sequence | None = None, queued: bool = False) -> bool:
        """Free the blocks of a sequence that holds some but is not running: the longest-paused one (it stays
        paused), else (queued=True) the last continued turn in the queue other than `keep`; either is
        recomputed in full when it next runs. False when there is none."""
        seq = next((s for s in self.paused if s.block_table), None)
        if seq is None and queued:
            seq = next((u.leader for u in reversed(self.waiting) if u.leader is not keep and u.leader.block_table),
                       None)
        if seq is None:
            return False
        self.blocks.free(seq)
        seq.num_cached = 0
        self.num_evictions += 1
        return True

"""Continuous-batching scheduler: picks each step's work and preempts by recompute when blocks run out.

Every step is either a prefill step (new prompts or resumed sequences, packed without padding, at most
`max_num_batched_tokens` tokens) or a decode step (one token for each running sequence). Prefill goes first
so that new groups join the running batch as soon as there is room, as in nano-vllm.

Preemption by recompute: when a decode step needs a fresh block and none is free, the most recently
admitted sequence gives its blocks back and returns to the front of the queue with its generated tokens;
when admitted again it is prefilled from scratch (prompt + generated tokens) and continues where it left off.
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


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[PrefillUnit] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, unit: PrefillUnit) -> None:
        self.waiting.append(unit)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = self._schedule_prefill()
        if step is not None:
            return step
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledStep | None:
        units: list[PrefillUnit] = []
        num_tokens = 0
        num_seqs = len(self.running)
        copies: list[tuple[int, int]] = []
        while self.waiting:
            unit = self.waiting[0]
            need = self.blocks.blocks_to_prefill(unit.num_tokens, len(unit.seqs))
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

    def _schedule_decode(self) -> ScheduledStep:
        # Fast path (almost every step): the blocks that sequences crossing a boundary need are free.
        size = self.blocks.block_size
        needing = [s for s in self.running if (len(s.token_ids) - 1) // size >= len(s.block_table)]
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
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(PrefillUnit([seq]))

    def finish(self, seqs: list[Sequence]) -> None:
        """Release the blocks of sequences that just finished and drop them from the running set."""
        done = False
        for seq in seqs:
            if seq.finish_reason is not None and seq.status is Status.RUNNING:
                seq.status = Status.FINISHED
                self.blocks.free(seq)
                done = True
        if done:
            self.running = deque(s for s in self.running if s.status is Status.RUNNING)

"""Paged KV-cache bookkeeping: fixed-size blocks with reference counts.

Pure Python, no tensors: the model runner owns the cache memory, this class only decides which block ids a
sequence's tokens live in. A block with a reference count above one is read-only (a group's shared prompt);
a sequence only ever writes into a block it owns alone.

Group sharing: after the leader of a group is prefilled, `fork` gives every other sample the leader's full
prompt blocks (reference count + 1) and a private copy of the partially filled last block (the copy of its
KV is done by the runner from the returned (src, dst) pairs). So G samples cost one prompt's KV plus at
most G-1 partial blocks.
"""

from __future__ import annotations

from collections import deque

from cohort.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_prefill(self, num_tokens: int, group_size: int) -> int:
        """Blocks a prefill unit needs: the prompt once, plus one private partial block per extra sample."""
        partial = 1 if num_tokens % self.block_size else 0
        return self.blocks_for(num_tokens) + partial * (group_size - 1)

    def blocks_for_unit(self, unit) -> int:
        """Free blocks a prefill unit takes: a fresh group's (see blocks_to_prefill), or for a continued turn
        only the blocks its new tokens need beyond the ones it holds."""
        seq = unit.leader
        if seq.num_cached:
            return self.blocks_for(len(seq)) - len(seq.block_table)
        return self.blocks_to_prefill(len(seq), len(unit.seqs))

    def needs_block_for_append(self, seq: Sequence) -> bool:
        """Whether the next decode step writes into a block the sequence does not have yet.

        The decode step writes the KV of the last token, at position len(seq) - 1.
        """
        return (len(seq) - 1) // self.block_size >= len(seq.block_table)

    # ---- mutations -------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("KV cache out of blocks: the scheduler should have preempted first (bug).")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence) -> None:
        """Blocks for all of seq's tokens (its prefill); a continued turn keeps its blocks and gets the rest.

        The block a continued turn writes first (its last sampled token's) is its own: shared blocks are full
        prompt blocks, and a turn's tokens all come after the prompt."""
        assert seq.num_cached or not seq.block_table, "allocate() on a sequence that already holds blocks"
        seq.block_table += [self._take() for _ in range(self.blocks_for(len(seq)) - len(seq.block_table))]

    def fork(self, leader: Sequence, followers: list[Sequence]) -> list[tuple[int, int]]:
        """Share the leader's blocks with the followers; returns (src, dst) partial blocks to copy."""
        copies: list[tuple[int, int]] = []
        table = leader.block_table
        partial = len(leader) % self.block_size != 0
        full = table[:-1] if partial else table
        for seq in followers:
            for block in full:
                self.ref_counts[block] += 1
            seq.block_table = list(full)
            if partial:
                dst = self._take()
                seq.block_table.append(dst)
                copies.append((table[-1], dst))
        return copies

    def append_block(self, seq: Sequence) -> None:
        seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks nobody else holds go back to the pool."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

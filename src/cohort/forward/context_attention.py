"""Context parallelism's attention: one packed row split over the ranks of a group, computed exactly.

Layout (train.context_parallel = C). A row of L tokens (padded to a multiple of 2C, `cohort.forward.context_rows`)
is cut into 2C chunks of s = L / 2C positions; rank r of the group holds chunks r and 2C - 1 - r (the zig-zag
that gives every rank the same causal work: an early chunk, cheap, with a late one, dear). Each rank runs the
decoder on its 2s tokens only, with their global per-segment position ids (so RoPE rotates them as in the whole
row).

Attention. In every layer the rank's keys and values ([2s, KV heads, head dim], concatenated into one tensor)
are all-gathered over the group by the `gather` it is given (cohort.distributed.context_parallel: an autograd
all-gather whose backward reduce-scatters the K/V gradients to the ranks that own them), put back in row order,
and each local chunk of queries attends to the keys of its segments: a query at row position i of segment
[a, b) sees keys a..i (and, on a sliding-window layer, the last W of them), exactly the mask of the whole row.
A chunk that starts inside a segment takes that segment's keys from its start; a chunk's query segments are
thus shorter than their key segments and aligned to their end, the varlen kernels' causal convention (as for a
shared prompt). Off CUDA or in fp32 the exact per-segment SDPA of cohort.forward.packed_attention runs; on CUDA
in bf16/fp16 the flash varlen kernel of model.packed_attention. The attention math is the whole row's: no
log-sum-exp merging is needed, each query sees all its keys in one kernel call.

Cost per layer and rank: one all-gather of (C - 1) x 2s x 2 x KV heads x head dim elements in the forward (and
again in the backward of a recomputed layer), one reduce-scatter of the same size in the backward; the gathered
keys and values of the chunk's key span (at most L rows) are kept for the backward.

This module needs no process group: the row's `ContextShard` carries the group's collectives as callables
(`gather` for K/V, `reduce` for the logprobs), given by the distributed layer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cohort.forward.packed_attention import (
    _fa4_varlen,
    _flash_eligible,
    _flash_varlen,
    _segment_sdpa,
    packed_kernel,
)

# all-gather along dim 0 over the context-parallel group, rank-major: [T, ...] -> [C * T, ...], differentiable
Gather = Callable[[torch.Tensor], torch.Tensor]
# sum over the group of tensors that are zero outside the entries each rank owns (backward: the same gradient)
Reduce = Callable[[torch.Tensor], torch.Tensor]


def zigzag_chunks(length: int, size: int, rank: int) -> list[tuple[int, int]]:
    """The two [start, end) chunks of a row of `length` positions that rank `rank` of `size` holds: chunks rank
    and 2 * size - 1 - rank of 2 * size equal chunks. length must be a multiple of 2 * size."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} of {size} is not a rank of the group")
    if length % (2 * size):
        raise ValueError(f"a context-parallel row of {length} tokens does not split into {2 * size} equal chunks")
    s = length // (2 * size)
    return [(rank * s, (rank + 1) * s), ((2 * size - 1 - rank) * s, (2 * size - rank) * s)]


def chunk_home(chunk: int, size: int) -> tuple[int, int]:
    """(rank, slot 0 or 1) holding global chunk `chunk` of 2 * size in the zig-zag layout."""
    return (chunk, 0) if chunk < size else (2 * size - 1 - chunk, 1)


@dataclass
class ChunkPieces:
    """How one local chunk [start, end) of queries meets the row's segments: `cu_q` cuts its queries by segment,
    `cu_k` cuts the keys [key_start, end) that those segments see (from the first segment's start)."""

    start: int
    end: int
    key_start: int
    cu_q: list[int]
    cu_k: list[int]
    max_q: int
    max_k: int
    device_cu: tuple[torch.Tensor, torch.Tensor] | None = None  # (cu_q, cu_k) int32 on the device, for flash


def chunk_pieces(cu: np.ndarray, start: int, end: int) -> ChunkPieces:
    """The segments of a row (cumulative bounds `cu`, ending at the padded length) that meet [start, end)."""
    first = int(np.searchsorted(cu, start, side="right")) - 1  # the segment holding `start`
    last = int(np.searchsorted(cu, end, side="left"))  # the first bound at or after `end`
    bounds = [int(b) for b in cu[first:last]]  # the meeting segments' starts
    key_start = bounds[0]
    q_bounds = [start, *bounds[1:], end]
    k_bounds = [*bounds, end]
    cu_q = [b - start for b in q_bounds]
    cu_k = [b - key_start for b in k_bounds]
    return ChunkPieces(start, end, key_start, cu_q, cu_k, max(int(np.diff(cu_q).max()), 1),
                       max(int(np.diff(cu_k).max()), 1))


@dataclass
class ContextShard:
    """One rank's share of a context-parallel packed row: what its attention layers and its logprobs need.

    chunks: the rank's local chunks (row positions), in the order of its tokens. size / rank: the group.
    gather / reduce: the group's collectives (module docstring). completion_index: where each of this rank's
    logprobs sits among the row's completion tokens, of which there are `completion_total`."""

    size: int
    rank: int
    length: int
    chunks: list[ChunkPieces]
    gather: Gather
    reduce: Reduce
    completion_index: torch.Tensor
    completion_total: int

    # Not a field: FSDP2 rebuilds the dataclasses among a forward's inputs (dataclasses.replace) when it casts
    # them to the compute dtype, and replace() cannot pass a field that __init__ does not take.
    @functools.cached_property
    def _span(self) -> tuple[int, int]:
        """The whole chunks of the row whose keys some local query sees: gathered back into row order once a layer."""
        s = self.length // (2 * self.size)
        return min(c.key_start for c in self.chunks) // s, max(c.end for c in self.chunks) // s

    def to(self, device: torch.device) -> ContextShard:
        """The flash kernels' segment bounds on `device` (built once per row, beside its other tensors)."""
        for c in self.chunks:
            both = torch.tensor(c.cu_q + c.cu_k, dtype=torch.int32).to(device, non_blocking=True)
            c.device_cu = (both[: len(c.cu_q)], both[len(c.cu_q):])
        self.completion_index = self.completion_index.to(device, non_blocking=True)
        return self

    def attend(self, query, key, value, scaling, window: int | None):
        """transformers' attention on this rank's tokens: query [1, Hq, T, D], key/value [1, Hkv, T, D] ->
        [1, T, Hq, D]; T = the local chunks' tokens, each query seeing the row's keys of its segment."""
        heads = key.shape[1]
        local = torch.cat([key[0], value[0]], dim=0).transpose(0, 1)  # [T, 2 Hkv, D]: one collective for both
        keys, values, offset = self._row_order(self.gather(local.contiguous()), heads)
        outs, at = [], 0
        flash = _flash_eligible(query)
        for c in self.chunks:
            n = c.end - c.start
            q = query[:, :, at: at + n]
            k = keys[c.key_start - offset: c.end - offset]
            v = values[c.key_start - offset: c.end - offset]
            if flash:
                outs.append(self._flash(q, k, v, c, scaling, window))
            else:
                outs.append(_segment_sdpa(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          torch.tensor(c.cu_q), torch.tensor(c.cu_k), scaling, window)[0])
            at += n
        return torch.cat(outs, dim=0).unsqueeze(0)

    def _row_order(self, gathered: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The gathered [C * 2s, 2 Hkv, D] (rank-major: each rank's two chunks) as keys and values in row order
        over the chunks some local query needs, and the row position of their first row."""
        s = self.length // (2 * self.size)
        lo, hi = self._span
        pieces = []
        for chunk in range(lo, hi):
            home, slot = chunk_home(chunk, self.size)
            begin = (2 * home + slot) * s
            pieces.append(gathered[begin: begin + s])
        # two contiguous tensors (cat copies), as the flash kernels want them
        keys = torch.cat([p[:, :heads] for p in pieces])
        values = torch.cat([p[:, heads:] for p in pieces])
        return keys, values, lo * s

    @staticmethod
    def _flash(q, k, v, c: ChunkPieces, scaling, window):
        assert c.device_cu is not None, "ContextShard.to(device) builds the flash kernels' bounds"
        attend = _fa4_varlen if packed_kernel() == "fa4" else _flash_varlen
        return attend(q[0].transpose(0, 1), k, v, c.device_cu[0], c.device_cu[1], c.max_q, c.max_k, scaling, window)

    def combine(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's per-token values (logprobs, entropy) -> the row's, in completion order, on every rank."""
        whole = local.new_zeros(self.completion_total).index_put((self.completion_index,), local)
        return self.reduce(whole)

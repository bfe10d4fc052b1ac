"""A context-parallel row's ContextShard survives FSDP2's cast of a forward's inputs.

With a low-precision MixedPrecisionPolicy (bf16 compute, every GPU run), FSDP2 passes a root forward's kwargs
through torch.distributed.utils._apply_to_tensors, which rebuilds each dataclass with dataclasses.replace.
A field declared init=False made that raise on the first GPU run of bench/context_parallel.py (the CPU runs
compute in float32, where FSDP2 casts nothing). This calls the function FSDP2 calls, with its cast.
"""

from __future__ import annotations

import torch
from torch.distributed.utils import _apply_to_tensors

from cohort.forward.context_attention import ContextShard, chunk_pieces
from cohort.forward.context_rows import local_layout


def _shard(rank: int) -> ContextShard:
    sequences = [([1, 2, 3], [4, 5, 6, 7, 8]), ([9, 10], [11, 12, 13, 14, 15, 16, 17])]
    lay = local_layout(sequences, 2, rank)
    return ContextShard(size=2, rank=rank, length=lay["length"],
                        chunks=[chunk_pieces(lay["cu"], a, b) for a, b in lay["chunks"]], gather=lambda t: t,
                        reduce=lambda t: t, completion_index=torch.as_tensor(lay["completion_index"]),
                        completion_total=lay["completions"])


def test_fsdp2_input_cast_rebuilds_the_shard_unchanged():
    def cast(t: torch.Tensor) -> torch.Tensor:  # FSDP2's cast_fn: floating tensors to the compute dtype
        return t.to(torch.bfloat16) if torch.is_floating_point(t) else t

    for rank in (0, 1):
        shard = _shard(rank)
        out = _apply_to_tensors(cast, {"max_len": 9, "context": shard})["context"]
        assert isinstance(out, ContextShard)
        assert out._span == shard._span and out.length == shard.length
        assert torch.equal(out.completion_index, shard.completion_index)
        assert out.completion_index.dtype == shard.completion_index.dtype
        assert [(c.start, c.end, c.key_start) for c in out.chunks] == [(c.start, c.end, c.key_start) for c in shard.chunks]

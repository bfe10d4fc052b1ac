"""One rank's share of a context-parallel packed row (train.context_parallel > 1).

The row is laid out as the plain packed row (`cohort.forward.packing.host_layout`: each (prompt, completion)
after the other, positions restarting per sequence), padded to a multiple of 2C tokens with a segment of its
own that nothing attends to and nothing is predicted from (at most 2C - 1 tokens), and cut into the zig-zag
chunks of `cohort.forward.context_attention`. The rank keeps its chunks' token ids and *global* position ids
(RoPE sees the positions of the whole row), the hidden-state rows that predict completion tokens inside its
chunks with their labels (a label may be a token of another rank's chunk: the host has the whole row), and
where each of those logprobs sits in the row's completion order, so that the packed pass returns the whole
row's logprobs on every rank of the group (`ContextShard.combine`).

Not supported here (refused by the config checks, and here for direct callers): shared-prompt rows
(train.share_prompts) and prompts with inputs besides their ids (images).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cohort.forward.context_attention import ContextShard, Gather, Reduce, chunk_pieces, zigzag_chunks
from cohort.forward.packed_attention import VARLEN_IMPL, enable_packed_attention
from cohort.forward.packing import PackedRow, _to_device, host_layout
from cohort.forward.plugins import has_extra_inputs


def padded_length(tokens: int, size: int) -> int:
    """The row length a context-parallel group of `size` runs: tokens rounded up to a multiple of 2 * size."""
    return -(-tokens // (2 * size)) * (2 * size)


def local_layout(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], size: int, rank: int) -> dict:
    """The host arrays of rank `rank`'s share of the row of `sequences` (module docstring): ids, positions,
    hidden index and labels of its tokens, where its logprobs go, the row's segment bounds, the completion
    offsets, the padded length and the longest sequence."""
    ids, pos, hidden, labels, cu, offsets = host_layout(sequences)
    length = padded_length(len(ids), size)
    pad = length - len(ids)
    if pad:  # a segment of its own: its tokens attend only to each other, and no label comes from it
        ids = np.concatenate([ids, np.zeros(pad, dtype=np.int64)])
        pos = np.concatenate([pos, np.arange(pad, dtype=np.int64)])
        cu = np.concatenate([cu, [length]])
    chunks = zigzag_chunks(length, size, rank)
    mine = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in chunks])
    # the hidden states this rank computes: row position -> position among its tokens
    local_of = np.full(length, -1, dtype=np.int64)
    local_of[mine] = np.arange(len(mine), dtype=np.int64)
    owned = local_of[hidden] >= 0
    return {"ids": ids[mine], "positions": pos[mine], "hidden": local_of[hidden[owned]], "labels": labels[owned],
            "completion_index": np.flatnonzero(owned).astype(np.int64), "completions": len(hidden), "cu": cu,
            "offsets": offsets, "length": length, "chunks": chunks,
            "max_len": int(np.diff(cu).max(initial=1))}


def pack_context_row(model, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *, size: int, rank: int,
                     gather: Gather, reduce: Reduce) -> PackedRow:
    """This rank's PackedRow of `sequences` for `packed_forward_logprobs(..., row=...)`: its tokens, and in
    its options the ContextShard its attention layers and logprobs use (gather / reduce: the group's
    collectives, cohort.distributed.context_parallel)."""
    if not sequences:
        raise ValueError("packed_forward_logprobs got no sequences")
    if has_extra_inputs([prompt for prompt, _ in sequences]):
        raise ValueError("train.context_parallel > 1 cannot train on prompts with inputs besides their token ids "
                         "(images): set train.context_parallel=1")
    enable_packed_attention(model)
    impl = str(model.config._attn_implementation)
    if impl != VARLEN_IMPL:  # a flash-attention model reads cu_seq_lens itself and would attend chunk-locally
        raise ValueError(f"train.context_parallel > 1 needs cohort's packed attention, but the model runs "
                         f"{impl!r}; load it with model.attn_implementation=sdpa")
    lay = local_layout(sequences, size, rank)
    device = model.get_input_embeddings().weight.device
    ids_t, pos_t, hidden_t, labels_t, cu_t, index_t = _to_device(
        device, lay["ids"], lay["positions"], lay["hidden"], lay["labels"], lay["cu"], lay["completion_index"])
    shard = ContextShard(size=size, rank=rank, length=lay["length"],
                         chunks=[chunk_pieces(lay["cu"], a, b) for a, b in lay["chunks"]], gather=gather,
                         reduce=reduce, completion_index=index_t, completion_total=lay["completions"])
    if device.type == "cuda":
        shard.to(device)
    return PackedRow((ids_t.view(1, -1), pos_t.view(1, -1), cu_t.int(), hidden_t, labels_t),
                     {"max_len": lay["max_len"], "context": shard}, lay["offsets"], len(sequences))

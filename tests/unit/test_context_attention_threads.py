"""Context parallelism over 3 and 4 ranks, simulated by threads (tests/helpers/thread_ranks.py): the row split
over the group gives the single-rank logprobs, loss and (summed over the ranks) gradients, float32 on the CPU.

tests/integration/test_context_parallel.py checks 2 ranks over real gloo collectives; here more ranks cut the
row into 6 and 8 zig-zag chunks, so sequences span several chunks held by several ranks, and the padding (5 and
3 tokens) shares a chunk with the last sequence.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers.thread_ranks import ThreadGroup, run_ranks
from tests.integration.test_context_parallel import LOSSES, SHAPES, forward_backward, sequences, tiny

from cohort.forward.context_rows import local_layout, pack_context_row

TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("size", [3, 4])
def test_a_row_split_over_more_ranks_equals_one_rank(family, size):
    torch.set_num_threads(1)
    model, seqs = tiny(family), sequences()
    assert local_layout(seqs, size, 0)["length"] > sum(p + c for p, c in SHAPES)  # padded: 37 -> 42 or 40
    single = {name: forward_backward(model, seqs, name) for name in LOSSES}
    copies = [copy.deepcopy(model) for _ in range(size)]
    group = ThreadGroup(size)

    def rank_work(rank: int) -> dict:
        out = {}
        for name in LOSSES:
            row = pack_context_row(copies[rank], seqs, size=size, rank=rank, gather=group.gather(rank),
                                   reduce=group.reduce(rank))
            out[name] = forward_backward(copies[rank], seqs, name, row=row)
        return out

    ranks = run_ranks(size, rank_work)
    for name in LOSSES:
        for rank in range(size):
            for what in ("logprobs", "entropy", "loss"):
                torch.testing.assert_close(ranks[rank][name][what], single[name][what], **TOL)
        for param, grad in single[name]["grads"].items():
            summed = sum(ranks[r][name]["grads"][param] for r in range(size))
            torch.testing.assert_close(summed, grad, **TOL, msg=f"{name}: grad of {param}")

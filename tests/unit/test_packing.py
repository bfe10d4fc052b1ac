"""split_micro_batches: every sequence once, budget respected, balanced loads."""

import random

import pytest

from cohort.forward.micro_batches import split_micro_batches


def _check(lengths, budget, bins):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= budget or len(b) == 1


def test_hand_example():
    lengths = [50, 30, 70, 20, 40, 10]  # total 220, budget 100 -> at least 3 bins
    bins = split_micro_batches(lengths, 100)
    _check(lengths, 100, bins)
    assert len(bins) == 3
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert loads == [70, 70, 80]  # LPT: 70 | 50+20 | 40+30+10


def test_long_sequence_alone():
    bins = split_micro_batches([10, 500, 20], 100)
    assert [1] in bins
    _check([10, 500, 20], 100, bins)


def test_random_invariants():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(50, 1000)
        bins = split_micro_batches(lengths, budget)
        _check(lengths, budget, bins)
        # Never more micro-batches than one per sequence, never fewer than the token total requires.
        assert len(bins) >= -(-sum(min(n, budget) for n in lengths) // budget) - sum(n > budget for n in lengths)


def test_empty_and_bad_budget():
    assert split_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="token_budget"):
        split_micro_batches([1], 0)


def test_pack_layout_hand_example():
    import torch

    from cohort.forward.packing import pack_layout

    ids, pos, cu, hidden_idx, labels, offsets = pack_layout([([5, 6], [7, 8, 9]), ([1], []), ([2, 3], [4])], "cpu")
    assert ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0, 0, 1, 2]]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 6, 9]
    # completion token k of a sequence is predicted by the hidden state just before it
    assert hidden_idx.tolist() == [1, 2, 3, 7]
    assert labels.tolist() == [7, 8, 9, 4]
    assert offsets == [0, 3, 3, 4]


def test_padded_scatters_values_and_gathers_gradients():
    import torch

    from cohort.forward.packing import PackedLogprobs

    flat = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    packed = PackedLogprobs(flat, None, [0, 3, 3, 4])
    out = packed.padded("logprobs", pad_value=-1.0)
    assert out.tolist() == [[1.0, 2.0, 3.0], [-1.0, -1.0, -1.0], [4.0, -1.0, -1.0]]
    (out * torch.arange(9.0).view(3, 3)).sum().backward()
    assert flat.grad.tolist() == [0.0, 1.0, 2.0, 6.0]
    assert packed.padded("logprobs").tolist()[2] == [4.0, 0.0, 0.0]  # the cached index, another pad value
    with pytest.raises(ValueError, match="entropy was not computed"):
        packed.padded("entropy")

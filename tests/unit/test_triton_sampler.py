"""triton_ops.fused_sample (vocabulary slices per row, then a combine kernel) against the PyTorch sampler's
functions on the CPU under TRITON_INTERPRET=1: the same Gumbel-max draws (sampler.gumbel_noise) and the
same logprobs, for several slicings, and the smallest token id on ties (torch.argmax's rule).

The interpreter must be on when triton_ops is first imported (a reloaded module's nested @triton.jit helper
is not interpreted), so the kernels run in one child process: this file run as a script.
Skips without Triton (it is not a project dependency; `pip install triton` to run these)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import run_interpreted


def _reference(logits, inv_t, noise, seeds, positions):
    from cohort.engine.sampler import gumbel_noise, row_keys

    keys = torch.from_numpy(row_keys(seeds.numpy(), positions.numpy()))
    scaled = logits.float() * inv_t[:, None]
    tokens = (scaled + noise[:, None] * gumbel_noise(keys, logits.shape[1])).argmax(-1)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)


def _check_draws(triton_ops, race: bool = False) -> None:
    for vocab in (1000, 4096):
        for splits in (1, 3, 8):
            g = torch.Generator().manual_seed(vocab + splits)
            rows = 5
            logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16)
            seeds = torch.randint(0, 2**62, (rows,), generator=g)
            positions = torch.randint(0, 5000, (rows,), generator=g)
            inv_t = torch.rand(rows, generator=g) + 0.5
            noise = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0])  # rows 2 and 4 greedy
            tokens, logprobs = triton_ops.fused_sample(logits, logits, inv_t, noise, seeds, positions,
                                                       splits=splits, block_v=256, num_warps=4, race=race)
            ref_tokens, ref_lp = _reference(logits, inv_t, noise, seeds, positions)
            assert tokens.tolist() == ref_tokens.tolist(), (vocab, splits, race)
            torch.testing.assert_close(logprobs, ref_lp, atol=1e-5, rtol=1e-5)


def _check_ties(triton_ops, race: bool = False) -> None:
    logits = torch.zeros(2, 1024)
    logits[:, [700, 100, 900]] = 5.0  # greedy: three equal maxima in different slices
    zeros = torch.zeros(2, dtype=torch.long)
    tokens, _ = triton_ops.fused_sample(logits, logits, torch.ones(2), torch.zeros(2), zeros, zeros, splits=4,
                                        block_v=256, num_warps=4, race=race)
    assert tokens.tolist() == [100, 100]


def _check_race_on_many_rows(triton_ops) -> None:
    """400 rows of peaked and flat 64-token rows, some tokens at -inf (never drawn): the race's draws are the
    torch Gumbel sampler's, row for row."""
    g = torch.Generator().manual_seed(7)
    rows = 400
    logits = torch.randn(rows, 64, generator=g) * torch.linspace(0.1, 6.0, rows)[:, None]
    logits[:, 60:] = float("-inf")
    seeds = torch.randint(0, 2**62, (rows,), generator=g)
    positions = torch.randint(0, 5000, (rows,), generator=g)
    inv_t, noise = torch.ones(rows), torch.ones(rows)
    # 16-token blocks: every lane meets 4 tokens, so the running maximum moves and the best weight is rescaled
    tokens, logprobs = triton_ops.fused_sample(logits, logits, inv_t, noise, seeds, positions, splits=1,
                                               block_v=16, num_warps=1, race=True)
    ref_tokens, ref_lp = _reference(logits, inv_t, noise, seeds, positions)
    assert tokens.max() < 60
    assert (tokens == ref_tokens).float().mean() >= 0.995  # float near-ties aside
    same = tokens == ref_tokens
    torch.testing.assert_close(logprobs[same], ref_lp[same], atol=1e-5, rtol=1e-5)


def test_sliced_sampler_draws_what_the_torch_sampler_draws_and_breaks_ties_low():
    pytest.importorskip("triton")
    run_interpreted(__file__, "sampler ok")


def test_race_needs_the_logits_as_choice():
    pytest.importorskip("triton")
    from cohort.engine.triton_ops import fused_sample

    logits = torch.zeros(1, 8)
    zero = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="choice=logits"):
        fused_sample(logits, logits.clone(), torch.ones(1), torch.ones(1), zero, zero, race=True)


def test_default_slicing_fills_the_gpu_and_keeps_whole_blocks():
    pytest.importorskip("triton")
    from cohort.engine.triton_ops import sample_splits

    assert sample_splits(256, 151936) == 8
    assert sample_splits(1, 151936) == 64
    assert sample_splits(4096, 151936) == 1
    assert sample_splits(1, 3000) == 2  # never more slices than blocks of the vocabulary


if __name__ == "__main__":
    from cohort.engine import triton_ops as _ops

    for _race in (False, True):  # the two-log Gumbel pass and the one-log exponential race
        _check_draws(_ops, _race)
        _check_ties(_ops, _race)
    _check_race_on_many_rows(_ops)
    print("sampler ok")

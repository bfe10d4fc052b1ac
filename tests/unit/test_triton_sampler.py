"""triton_ops.fused_sample (vocabulary slices per row, then a combine kernel) against the PyTorch sampler's
functions on the CPU under TRITON_INTERPRET=1: the same Gumbel-max draws (sampler.gumbel_noise) and the
same logprobs, for several slicings, and the smallest token id on ties (torch.argmax's rule); its inverse-CDF
pass (triton_cdf, method="cdf") against that pass's float64 reference and by its frequencies.

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


def _check_draws(triton_ops) -> None:
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
                                                       splits=splits, block_v=256, num_warps=4)
            ref_tokens, ref_lp = _reference(logits, inv_t, noise, seeds, positions)
            assert tokens.tolist() == ref_tokens.tolist(), (vocab, splits)
            torch.testing.assert_close(logprobs, ref_lp, atol=1e-5, rtol=1e-5)
            # filtered rows: the draw from the processed values (here a top-50 cut), the logprob from the logits
            cut = logits.float().topk(50, dim=-1).values[:, -1:]
            choice = torch.where(logits.float() >= cut, logits.float(), float("-inf")).to(logits.dtype)
            tokens, logprobs = triton_ops.fused_sample(logits, choice, inv_t, noise, seeds, positions,
                                                       splits=splits, block_v=256, num_warps=4)
            drawn, _ = _reference(choice, inv_t, noise, seeds, positions)
            assert tokens.tolist() == drawn.tolist() and bool((choice.gather(1, tokens[:, None]) > -1e30).all())
            scaled = logits.float() * inv_t[:, None]
            want = scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)
            torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=1e-5)


def _check_ties(triton_ops, method: str = "gumbel") -> None:
    logits = torch.zeros(2, 1024)
    logits[:, [700, 100, 900]] = 5.0  # greedy: three equal maxima in different slices
    zeros = torch.zeros(2, dtype=torch.long)
    tokens, _ = triton_ops.fused_sample(logits, logits, torch.ones(2), torch.zeros(2), zeros, zeros, splits=4,
                                        block_v=256, num_warps=4, method=method)
    assert tokens.tolist() == [100, 100]


def _check_cdf(triton_ops) -> None:
    """The inverse-CDF pass against its float64 reference: the same token on (nearly) every row for several
    slicings and temperatures, greedy rows the argmax, -inf tokens never drawn, logprobs log_softmax's; and
    on 1,000 rows of one 6-token distribution, frequencies within 4 sigma of the probabilities."""
    from cohort.engine.sampler import row_keys
    from cohort.engine.triton_cdf import cdf_sample_reference

    for vocab, splits in ((1000, 1), (1000, 3), (4096, 8)):
        g = torch.Generator().manual_seed(vocab * 7 + splits)
        rows = 64
        logits = (torch.randn(rows, vocab, generator=g) * torch.linspace(0.2, 6.0, rows)[:, None]).to(torch.bfloat16)
        logits[:, -7:] = float("-inf")
        seeds = torch.randint(0, 2**62, (rows,), generator=g)
        positions = torch.randint(0, 5000, (rows,), generator=g)
        inv_t = torch.rand(rows, generator=g) + 0.5
        noise = (torch.arange(rows) % 5 != 0).float()  # every fifth row greedy
        tokens, logprobs = triton_ops.fused_sample(logits, logits, inv_t, noise, seeds, positions, splits=splits,
                                                   block_v=256, num_warps=4, method="cdf")
        keys = torch.from_numpy(row_keys(seeds.numpy(), positions.numpy()))
        ref_tokens, ref_lp = cdf_sample_reference(logits, inv_t, noise, keys)
        same = tokens == ref_tokens
        assert same.float().mean() >= 0.98, (vocab, splits, same.float().mean())  # boundary rounding aside
        assert same[noise == 0].all() and tokens.max() < vocab - 7
        scaled = logits.float() * inv_t[:, None]
        want = scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)
        torch.testing.assert_close(logprobs, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logprobs[same], ref_lp[same], atol=1e-4, rtol=1e-4)
    rows = 1000
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05, 0.0])
    logits = probs.log().expand(rows, -1).contiguous()
    tokens, _ = triton_ops.fused_sample(logits, logits, torch.ones(rows), torch.ones(rows),
                                        torch.arange(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                                        splits=2, block_v=4, num_warps=1, method="cdf")
    freq = torch.bincount(tokens, minlength=6).float() / rows
    assert freq[5] == 0 and ((freq - probs).abs() <= 4 * (probs * (1 - probs) / rows).sqrt() + 1e-9).all(), freq


def test_sliced_sampler_draws_what_the_torch_sampler_draws_and_breaks_ties_low():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    run_interpreted(__file__, "sampler ok")


def test_cdf_needs_the_logits_as_choice_and_methods_are_named():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    from cohort.engine.triton_ops import fused_sample

    logits = torch.zeros(1, 8)
    zero = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="choice=logits"):
        fused_sample(logits, logits.clone(), torch.ones(1), torch.ones(1), zero, zero, method="cdf")
    with pytest.raises(ValueError, match="gumbel, cdf"):
        fused_sample(logits, logits, torch.ones(1), torch.ones(1), zero, zero, method="top")


def test_default_slicing_fills_the_gpu_and_keeps_whole_blocks():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    from cohort.engine.triton_ops import sample_splits

    assert sample_splits(256, 151936) == 8
    assert sample_splits(1, 151936) == 64
    assert sample_splits(4096, 151936) == 1
    assert sample_splits(1, 3000) == 2  # never more slices than blocks of the vocabulary


if __name__ == "__main__":
    from cohort.engine import triton_ops as _ops

    _check_draws(_ops)
    _check_ties(_ops)
    _check_cdf(_ops)
    _check_ties(_ops, "cdf")
    print("sampler ok")

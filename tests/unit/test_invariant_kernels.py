"""The batch-invariance property of cohort.forward.invariant's kernels, on the CPU under TRITON_INTERPRET=1.

A row's output is bitwise the same when the batch around it changes size, when it moves in the batch, and when the
work is chunked or packed differently: the matmul (float32 and bfloat16), RMSNorm (Llama's and Gemma's), the SiLU and
GELU-tanh gates, the chosen-token
log-softmax, and attention, where one query's output is the same from the engine's decode (one token, paged
cache), the engine's prefill (a packed prompt) and a training row (a segment of a packed row with other segments
around it), including a context over several fixed-size splits and a sliding window. The kernels run in a child
process (the interpreter must be on when Triton first sees them); skips without Triton.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import patch_interpreter_index, run_interpreted


def _check_rowwise() -> None:
    from cohort.forward.invariant import kernels

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # K spans several K tiles, M several M tiles: a row lands in another tile and at another offset
        x = torch.randn(150, 200, generator=gen).to(dtype)
        w = torch.randn(96, 200, generator=gen).to(dtype)
        bias = torch.randn(96, generator=gen).to(dtype)
        full = kernels.linear(x, w, bias)
        for rows in ([7], [7, 3], list(range(149, 40, -3)), [0, 7, 149]):
            out = kernels.linear(x[rows], w, bias)
            assert torch.equal(out, full[rows]), (dtype, rows)
        # columns: a weight's rows alone (the projections fused or separate) give the same bits
        assert torch.equal(kernels.linear(x, w[10:50], bias[10:50]), full[:, 10:50])
        norm_w = torch.randn(200, generator=gen).to(dtype)
        normed = kernels.rms_norm(x, norm_w, 1e-6)
        assert torch.equal(kernels.rms_norm(x[[9, 3]], norm_w, 1e-6), normed[[9, 3]])
        gated = kernels.silu_mul(x[:, :100], x[:, 100:])
        assert torch.equal(kernels.silu_mul(x[5:6, :100], x[5:6, 100:]), gated[5:6])
        # Gemma's norm (times 1 + weight, one rounding) and GELU-tanh gate: row-wise, and HF's values
        gnormed = kernels.rms_norm(x, norm_w, 1e-6, offset=True)
        assert torch.equal(kernels.rms_norm(x[[9, 3]], norm_w, 1e-6, offset=True), gnormed[[9, 3]])
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(gnormed, (h * (1 + norm_w.float())).to(dtype))
        assert not torch.equal(gnormed, normed)
        gelu = kernels.gelu_tanh_mul(x[:, :100], x[:, 100:])
        assert torch.equal(kernels.gelu_tanh_mul(x[5:6, :100], x[5:6, 100:]), gelu[5:6])
        ref = torch.nn.functional.gelu(x[:, :100], approximate="tanh") * x[:, 100:]
        torch.testing.assert_close(gelu, ref, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)
        # logprobs: a vocabulary over several blocks, rows in another batch and order
        # a flat distribution: every term of the sum counts, so another summation order shows in the bits
        logits = (torch.randn(16, 9000, generator=gen) * 0.5).to(dtype)
        labels = torch.randint(0, 9000, (16,), generator=gen)
        inv = torch.full((16,), 1 / 0.7, dtype=torch.float32)
        chosen, lse = kernels.token_logprobs(logits, labels, inv)
        picks = [4, 1, 11]
        again, lse2 = kernels.token_logprobs(logits[picks], labels[picks], inv[picks])
        assert torch.equal(again, chosen[picks]) and torch.equal(lse2, lse[picks])
        ref = torch.log_softmax(logits.float() * inv[:, None], -1).gather(-1, labels[:, None])[:, 0]
        torch.testing.assert_close(chosen, ref, atol=1e-4, rtol=0)


def _segments(lens: list[int]):
    starts, positions, cu = [], [], [0]
    for n in lens:
        starts += [cu[-1]] * n
        positions += list(range(n))
        cu.append(cu[-1] + n)
    return torch.tensor(starts), torch.tensor(positions), cu


def _paged(k: torch.Tensor, v: torch.Tensor, block: int, blocks: int, gen):
    """One sequence's keys laid into a shuffled paged cache: (k_cache, v_cache, table [1, W])."""
    n = k.shape[0]
    width = -(-n // block)
    table = torch.randperm(blocks, generator=gen)[:width].to(torch.int32)
    k_cache = torch.randn(blocks, block, *k.shape[1:], generator=gen).to(k.dtype)
    v_cache = torch.randn(blocks, block, *k.shape[1:], generator=gen).to(k.dtype)
    for p in range(n):
        k_cache[table[p // block], p % block] = k[p]
        v_cache[table[p // block], p % block] = v[p]
    return k_cache, v_cache, table[None, :]


def _check_attention() -> None:
    from cohort.forward.invariant import attention

    gen = torch.Generator().manual_seed(1)
    # contexts over several tiles and splits at test sizes (the interpreter runs each program in Python)
    attention.ATTN_TILE, attention.SPLIT_KEYS = 16, 16
    heads, kv_heads, dim = 4, 2, 16
    for dtype, window in ((torch.float32, None), (torch.bfloat16, 20)):
        lens = [3, 40, 5]  # the 40-token segment's last queries fold 3 splits
        starts, pos, cu = _segments(lens)
        total = cu[-1]
        q = torch.randn(total, heads, dim, generator=gen).to(dtype)
        k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
        train = attention.attend_packed(q, k, v, starts, pos, 0.25, max(lens), window)
        ref = attention.reference(q.float(), k.float(), v.float(), cu, 0.25, window)
        torch.testing.assert_close(train.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
        # the 300-token segment packed alone (prefill of one prompt) and in another order with other segments
        a, b = cu[1], cu[2]
        alone = attention.attend_packed(q[a:b], k[a:b], v[a:b], torch.zeros(b - a, dtype=torch.long), pos[a:b], 0.25,
                                        b - a, window)
        assert torch.equal(alone, train[a:b])
        # decode: queries of that segment one at a time, its keys in a paged cache, in batches of other sizes
        k_cache, v_cache, table = _paged(k[a:b], v[a:b], 16, 12, gen)
        for picks in ([39], [0, 20, 39], [32, 31, 15, 16]):
            rows = torch.zeros(len(picks), dtype=torch.long)
            out = attention.attend_paged(q[[a + p for p in picks]], k_cache, v_cache, table, rows,
                                         torch.tensor(picks), 0.25, window)
            assert torch.equal(out, train[[a + p for p in picks]]), (dtype, window, picks)


def test_matmul_norm_gate_and_logprob_rows_do_not_depend_on_the_batch(monkeypatch):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    monkeypatch.setenv("COHORT_INVARIANT_PART", "rowwise")
    run_interpreted(__file__, "rowwise ok", timeout_s=300)


def test_attention_of_a_query_is_the_same_in_decode_prefill_and_training(monkeypatch):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    monkeypatch.setenv("COHORT_INVARIANT_PART", "attention")
    run_interpreted(__file__, "attention ok", timeout_s=300)


if __name__ == "__main__":
    import os

    patch_interpreter_index()
    part = os.environ.get("COHORT_INVARIANT_PART", "rowwise")
    {"rowwise": _check_rowwise, "attention": _check_attention}[part]()
    print(f"{part} ok")

"""Decode attention's input in one kernel: the QKV projection, its bias, RoPE on q and k, and the K/V cache write.

The decode path of models/decoder.py otherwise runs the fused QKV weight through cuBLAS (one GEMM with its
bias) and then triton_rope.rope_store_kv (one kernel). At a decode batch of 256 rows on a 0.5B model the GEMM
is ~4.5 us and the RoPE kernel ~2.6 us, both near the launch-latency floor, 24 times a step. Here each program
computes one head (64 or 128 output columns) for a tile of rows as two half-head products, so the rotation
pairs column i with column i + D/2 in registers, then stores q, or writes the rotated k / plain v to the paged
cache. The products accumulate in float32; the result is rounded to the model dtype (as the GEMM's output is)
and rotated with triton_rope's HF-eager rounding, so the values are the unfused path's up to the GEMM's
summation order.

Used for decode steps (not prefill: there attention reads the new tokens' k and v, which this does not
return) of models without q/k head norms, head sizes whose half is a power of two, and one RoPE table.
COHORT_FUSED_QKV_ROPE=0 in the environment (read when the engine's model forward is built) selects the
unfused path, for A/B runs.
"""

from __future__ import annotations

import os

import torch

from cohort.engine.triton_rope import triton

if triton is not None:
    import triton.language as tl

    from cohort.engine.triton_rope import _rotate_half_rope

ENV_SWITCH = "COHORT_FUSED_QKV_ROPE"


def fused_qkv_rope_supported(device: torch.device, head_dim: int) -> bool:
    """CUDA, Triton, a head size of 2 x a power of two >= 16, and the switch not set to 0."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    half = head_dim // 2
    return triton is not None and device.type == "cuda" and head_dim % 2 == 0 and half >= 16 \
        and half & (half - 1) == 0


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _qkv_rope_store_kernel(
        x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr,
        rows, hidden, block_size, stride_x, stride_w, stride_cos, stride_sin, stride_qt, stride_qh,
        stride_cb, stride_cs, stride_ch,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):
        head = tl.program_id(1)  # q heads, then k heads, then v heads
        t = tl.program_id(0) * BM + tl.arange(0, BM)
        t_ok = t < rows
        cols = tl.arange(0, HALF)
        w_lo = w_ptr + (head * 2 * HALF + cols)[None, :] * stride_w  # [1, HALF]: first half of the head
        w_hi = w_lo + HALF * stride_w
        acc1 = tl.zeros([BM, HALF], tl.float32)
        acc2 = tl.zeros([BM, HALF], tl.float32)
        for k0 in range(0, hidden, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < hidden
            x = tl.load(x_ptr + t[:, None] * stride_x + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            w1 = tl.load(w_lo + ks[:, None], mask=k_ok[:, None], other=0.0)
            w2 = tl.load(w_hi + ks[:, None], mask=k_ok[:, None], other=0.0)
            acc1 = tl.dot(x, w1, acc1, input_precision=PRECISION)
            acc2 = tl.dot(x, w2, acc2, input_precision=PRECISION)
        if HAS_BIAS:
            acc1 += tl.load(b_ptr + head * 2 * HALF + cols).to(tl.float32)[None, :]
            acc2 += tl.load(b_ptr + head * 2 * HALF + HALF + cols).to(tl.float32)[None, :]
        dt = q_ptr.dtype.element_ty
        y1 = acc1.to(dt)  # the GEMM's output in the model dtype, as the unfused path rounds it
        y2 = acc2.to(dt)
        mask = t_ok[:, None]
        if head < HEADS + KV_HEADS:
            c1 = tl.load(cos_ptr + t[:, None] * stride_cos + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + t[:, None] * stride_cos + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + t[:, None] * stride_sin + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + t[:, None] * stride_sin + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            o1, o2 = _rotate_half_rope(y1, y2, c1, c2, s1, s2)
            if head < HEADS:
                dst_q = q_ptr + t[:, None] * stride_qt + head * stride_qh + cols[None, :]
                tl.store(dst_q, o1, mask=mask)
                tl.store(dst_q + HALF, o2, mask=mask)
            else:
                slot_k = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
                dst_k = kc_ptr + ((slot_k // block_size) * stride_cb + (slot_k % block_size) * stride_cs)[:, None] \
                    + (head - HEADS) * stride_ch + cols[None, :]
                tl.store(dst_k, o1, mask=mask)
                tl.store(dst_k + HALF, o2, mask=mask)
        else:
            slot_v = tl.load(slot_ptr + t, mask=t_ok, other=0).to(tl.int64)
            dst_v = vc_ptr + ((slot_v // block_size) * stride_cb + (slot_v % block_size) * stride_cs)[:, None] \
                + (head - HEADS - KV_HEADS) * stride_ch + cols[None, :]
            tl.store(dst_v, y1, mask=mask)
            tl.store(dst_v + HALF, y2, mask=mask)


def tile_rows(rows: int) -> int:
    """Rows per program: 32 from 128 rows up (8 x 18 programs of a 0.5B layer at 256 rows), else 16."""
    return 32 if rows >= 128 else 16


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   heads: int, kv_heads: int, *, block_rows: int | None = None, block_k: int = 64,
                   num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """q [T, heads, D] of x [T, hidden] through the fused QKV weight [(heads + 2 kv_heads) D, hidden] (and bias),
    rotated by the per-token cos/sin [T, D]; the rotated k and the v of each token go into the caches
    [blocks, block_size, kv_heads, D] at slot_mapping [T]. Same values as `F.linear(x, weight, bias)`, split,
    then triton_rope.rope_store_kv (up to the products' summation order)."""
    rows, hidden = x.shape
    head_dim = k_cache.shape[-1]
    if weight.shape != ((heads + 2 * kv_heads) * head_dim, hidden) or weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"qkv_rope_store: weight {tuple(weight.shape)} for x {tuple(x.shape)}, {heads} + 2 x "
                         f"{kv_heads} heads of {head_dim}: expected [{(heads + 2 * kv_heads) * head_dim}, {hidden}], "
                         "both with a contiguous last dim")
    q = torch.empty(rows, heads, head_dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return q
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    bm = block_rows or tile_rows(rows)
    _qkv_rope_store_kernel[(triton.cdiv(rows, bm), heads + 2 * kv_heads)](
        x, weight, bias if bias is not None else weight, cos, sin, slot_mapping, q, k_cache, v_cache,
        rows, hidden, k_cache.shape[1], x.stride(0), weight.stride(0), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HALF=head_dim // 2, HAS_BIAS=bias is not None,
        # float32 models get exact float32 products (not tf32), so they match the unfused path
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BM=bm, BK=block_k,
        num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False,  # the rotation rounds each product like eager PyTorch (triton_rope)
    )
    return q

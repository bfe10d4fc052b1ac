"""One Triton launch per decoder layer for RoPE on q and k plus the K/V cache write.

The unfused path of models/decoder.py `_attention` is the compiled `layers.rope` (one or two kernels) then
`attention.store_kv` (two index_copy_ kernels). A decode step of a small model at batch 256 is bound by
kernel count, so `rope_store_kv` does all of it in one kernel: it rotates q and k in place (they are views of
the fused QKV GEMM output, or the q/k head norms' outputs: no copies) and writes the rotated k and v into
the paged cache at `slot_mapping`. It reads only device tensors, so it can live inside a CUDA graph.

Numerics are HF's `apply_rotary_pos_emb` run eagerly in the model dtype (what `layers.rope` computes when
not compiled): each product `x * cos`, `rotate_half(x) * sin` is rounded to the model dtype, then their sum
is. The kernel computes each step in float32 and rounds where eager PyTorch rounds, and it is compiled
without FMA contraction, so a float32 model gets the exact same bits too (tests compare under
TRITON_INTERPRET=1). The compiled `layers.rope` on the GPU keeps the intermediates in float32 instead, so
the old and the fused GPU paths may differ by one bf16 ulp; the fused one is the one that matches HF.

Grid: (tokens, q-head tiles + kv-head tiles). A program loads its token's cos/sin row once and handles a
tile of heads; q tiles only rotate, kv tiles rotate k and copy k and v into the cache. Any even head_dim
works (the half is padded to a power of two and masked); any head counts.

Switch: models/decoder.py uses this on CUDA when Triton is installed; COHORT_FUSED_ROPE_KV=0 in the
environment (read when the engine's model forward is built) selects the unfused path, for A/B runs.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

ENV_SWITCH = "COHORT_FUSED_ROPE_KV"


def fused_rope_kv_supported(device: torch.device, head_dim: int) -> bool:
    """Whether the decoder should use `rope_store_kv`: CUDA, Triton installed, an even head_dim, and the
    switch not set to 0."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return triton is not None and device.type == "cuda" and head_dim % 2 == 0


if triton is not None:

    @triton.jit
    def _rotate_half_rope(x1, x2, c1, c2, s1, s2):
        # HF: x * cos + cat(-x2, x1) * sin, every op rounded to the model dtype like eager PyTorch.
        dt = x1.dtype
        a1 = (x1.to(tl.float32) * c1).to(dt)
        # Negated in float32: exact, like in the model dtype (and the interpreter negates bf16 bits wrongly).
        b1 = (-(x2.to(tl.float32)) * s1).to(dt)
        a2 = (x2.to(tl.float32) * c2).to(dt)
        b2 = (x1.to(tl.float32) * s2).to(dt)
        o1 = (a1.to(tl.float32) + b1.to(tl.float32)).to(dt)
        o2 = (a2.to(tl.float32) + b2.to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _rope_store_kv_kernel(
        q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, block_size,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
        stride_cb, stride_cs, stride_ch,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, Q_TILES: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        dims = tl.arange(0, HALF_PAD)
        dim_ok = dims < HALF
        c1 = tl.load(cos_ptr + t * stride_cos + dims, mask=dim_ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_cos + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_sin + dims, mask=dim_ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_sin + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)
        # The two branches use their own names: Triton types a name assigned in both branches of a runtime
        # `if` once, and the q and kv tiles have different shapes.
        if tile < Q_TILES:
            qh = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
            q_ok = (qh < HEADS)[:, None] & dim_ok[None, :]
            q_lo = q_ptr + t * stride_qt + qh[:, None] * stride_qh + dims[None, :]
            q1, q2 = _rotate_half_rope(tl.load(q_lo, mask=q_ok), tl.load(q_lo + HALF, mask=q_ok), c1, c2, s1, s2)
            tl.store(q_lo, q1, mask=q_ok)
            tl.store(q_lo + HALF, q2, mask=q_ok)
        else:
            kh = (tile - Q_TILES) * BLOCK_KV + tl.arange(0, BLOCK_KV)
            kv_ok = (kh < KV_HEADS)[:, None] & dim_ok[None, :]
            slot = tl.load(slot_ptr + t).to(tl.int64)
            dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs \
                + kh[:, None] * stride_ch + dims[None, :]
            k_lo = k_ptr + t * stride_kt + kh[:, None] * stride_kh + dims[None, :]
            k1, k2 = _rotate_half_rope(tl.load(k_lo, mask=kv_ok), tl.load(k_lo + HALF, mask=kv_ok), c1, c2, s1, s2)
            # k is rotated in place too: prefill attends over the new tokens' k directly, not the cache.
            tl.store(k_lo, k1, mask=kv_ok)
            tl.store(k_lo + HALF, k2, mask=kv_ok)
            tl.store(kc_ptr + dst, k1, mask=kv_ok)
            tl.store(kc_ptr + dst + HALF, k2, mask=kv_ok)
            v_lo = v_ptr + t * stride_vt + kh[:, None] * stride_vh + dims[None, :]
            tl.store(vc_ptr + dst, tl.load(v_lo, mask=kv_ok), mask=kv_ok)
            tl.store(vc_ptr + dst + HALF, tl.load(v_lo + HALF, mask=kv_ok), mask=kv_ok)


def _check(name: str, x: torch.Tensor, want: torch.Tensor) -> None:
    if x.dtype != want.dtype or x.device != want.device:
        raise ValueError(f"rope_store_kv: {name} is {x.dtype} on {x.device}, expected {want.dtype} on "
                         f"{want.device} like q (cast the RoPE tables / cache to the model dtype).")


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, H, D] and k [T, Hkv, D] (per-token cos/sin [T, D]), then k and v [T, Hkv, D] into the
    caches [blocks, block_size, Hkv, D] at slot_mapping [T]; one kernel. Returns the rotated (q, k): the
    inputs themselves, rotated in place, unless their last dim was strided (then rotated copies).

    Same result as `q, k = layers.rope(q, k, cos, sin)` then `attention.store_kv(k_cache, v_cache, k, v,
    slot_mapping)` run eagerly."""
    if triton is None:
        raise RuntimeError("rope_store_kv needs Triton; use layers.rope + attention.store_kv without it.")
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"rope_store_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
                         "[T, H, D], [T, Hkv, D], [T, Hkv, D] with an even D.")
    if k_cache.shape[2:] != (kv_heads, head_dim) or k_cache.stride() != v_cache.stride() \
            or k_cache.shape != v_cache.shape or k_cache.stride(-1) != 1:
        raise ValueError(f"rope_store_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must both be "
                         f"[blocks, block_size, {kv_heads}, {head_dim}] with equal strides and a contiguous last dim.")
    for name, x in (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check(name, x, q)
    if tokens == 0:
        return q, k
    # The kernel addresses the last dim with unit stride (true of QKV-split views and norm outputs).
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (cos, sin))
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    # Tiles of about 1k elements per half: 16 q heads at D 64 / 128, 8 at D 256.
    cap = max(1, 1024 // half_pad)
    block_q = min(cap, triton.next_power_of_2(heads))
    block_kv = min(cap, triton.next_power_of_2(kv_heads))
    q_tiles = triton.cdiv(heads, block_q)
    grid = (tokens, q_tiles + triton.cdiv(kv_heads, block_kv))
    _rope_store_kv_kernel[grid](
        q, k, v, cos, sin, slot_mapping, k_cache, v_cache, k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEADS=heads, KV_HEADS=kv_heads, HALF=half, HALF_PAD=half_pad, BLOCK_Q=block_q, BLOCK_KV=block_kv,
        Q_TILES=q_tiles, num_warps=4 if block_q * half_pad >= 1024 else 2,
        # No FMA contraction: float32 models round each product like eager PyTorch does.
        enable_fp_fusion=False,
    )
    return q, k

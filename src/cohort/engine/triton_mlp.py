"""Decode MLP's second half in one Triton GEMM: SiLU(gate) * up computed while loading the down projection's input.

The decode path of models/decoder.py runs the fused gate/up GEMM, an elementwise SiLU-and-multiply kernel, then
the down GEMM. At a decode batch of 256 rows on a 0.5B model the elementwise kernel is ~3.7 us and the down GEMM
~10 us, 24 times a step: the down GEMM's output is only 2 x 7 tiles of 128, so cuBLAS runs it on few SMs, and
the SiLU kernel is a launch of its own. Here each program loads tiles of gate and up, applies SiLU and the
product in float32, rounds to the model dtype (what the elementwise kernel stores) and feeds the down GEMM;
the reduction over the intermediate size is split over SPLIT_K programs (each writes a float32 partial, a second
kernel sums them in a fixed order, so results do not depend on scheduling).

Used for decode steps of models whose MLP is SiLU-gated with a fused gate/up copy; COHORT_FUSED_SILU_DOWN=0 in
the environment (read when the engine's model forward is built) selects the unfused path, for A/B runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

ENV_SWITCH = "COHORT_FUSED_SILU_DOWN"


@dataclass(frozen=True)
class Tiling:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def default_tiling(rows: int) -> Tiling:
    """Tiles per decode batch (bench/engine_profile.py --silu-down)."""
    if rows > 128:
        return Tiling(128, 64, 64, 4, 8, 4)
    if rows > 64:
        return Tiling(64, 64, 128, 4, 4, 3)
    return Tiling(64, 64, 128, 8, 4, 3)


def fused_silu_down_supported(device: torch.device, intermediate: int) -> bool:
    """CUDA, Triton, an intermediate size of whole 128-wide tiles, and the switch not set to 0."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return triton is not None and device.type == "cuda" and intermediate % 128 == 0


if triton is not None:

    @triton.jit(do_not_specialize=["rows"])
    def _silu_down_kernel(gu_ptr, w_ptr, y_ptr, ws_ptr, rows, out_dim, inter, stride_gu, stride_w,
                          PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        k_tiles = inter // BLOCK_K
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, k_tiles)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m[:, None] < rows
        col_ok = offs_n[:, None] < out_dim
        g_ptrs = gu_ptr + offs_m[:, None].to(tl.int64) * stride_gu + (first * BLOCK_K + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (first * BLOCK_K + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        dt = w_ptr.dtype.element_ty
        for _ in range(first, last):
            g = tl.load(g_ptrs, mask=row_ok, other=0.0).to(tl.float32)
            u = tl.load(g_ptrs + inter, mask=row_ok, other=0.0).to(tl.float32)
            h = (g / (1.0 + tl.exp(-g)) * u).to(dt)  # SiLU(gate) * up, rounded as the elementwise kernel stores it
            b = tl.load(w_ptrs, mask=col_ok, other=0.0)
            acc = tl.dot(h, tl.trans(b), acc, input_precision=PRECISION)
            g_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_mask = row_ok & (offs_n[None, :] < out_dim)
        out_offs = offs_m[:, None] * out_dim + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(ws_ptr + pid_k * rows * out_dim + out_offs, acc, mask=out_mask)

    @triton.jit(do_not_specialize=["total"])
    def _split_sum_kernel(ws_ptr, y_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < total
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # a fixed order: the same sums whatever the schedule
            acc += tl.load(ws_ptr + s * total + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def silu_down(gate_up: torch.Tensor, weight: torch.Tensor, tiling: Tiling | None = None) -> torch.Tensor:
    """down_proj(SiLU(gate) * up) of gate_up [T, 2 I] (gate then up, the fused GEMM's output) with the down weight
    [H, I]: [T, H] in the weight's dtype. The same values as F.linear(silu_mul(gate, up), weight) up to the
    reduction's summation order."""
    rows, two_inter = gate_up.shape
    out_dim, inter = weight.shape
    tiling = tiling or default_tiling(rows)
    if two_inter != 2 * inter or inter % tiling.block_k or gate_up.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"silu_down: gate_up {tuple(gate_up.shape)}, weight {tuple(weight.shape)}: expected "
                         f"[T, 2 x {inter}] and [H, {inter}] with contiguous last dims and {inter} a multiple of "
                         f"{tiling.block_k}")
    y = torch.empty(rows, out_dim, dtype=weight.dtype, device=weight.device)
    if rows == 0:
        return y
    split = tiling.split_k
    ws = torch.empty(split, rows, out_dim, dtype=torch.float32, device=weight.device) if split > 1 else y
    grid = (triton.cdiv(out_dim, tiling.block_n), triton.cdiv(rows, tiling.block_m), split)
    _silu_down_kernel[grid](
        gate_up, weight, y, ws, rows, out_dim, inter, gate_up.stride(0), weight.stride(0),
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, SPLIT_K=split, num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if split > 1:
        _split_sum_kernel[(triton.cdiv(rows * out_dim, 1024),)](ws, y, rows * out_dim, SPLIT_K=split, BLOCK=1024,
                                                                 num_warps=4)
    return y

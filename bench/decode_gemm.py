"""Decode-step matmuls: cuBLAS (F.linear) against a split-K Triton kernel, per shape and batch (one GPU).

    PYTHONPATH=src:. python3 bench/decode_gemm.py [--rows 256 128 64]

For the Qwen2.5-0.5B and 1.5B architectures, the four matmuls of a decode layer as the engine runs them (fused
QKV with bias, o_proj, fused gate/up, down) and the LM head, at M rows: cuBLAS time and the best Triton config
(every config of candidate_configs below, each timed as a CUDA graph: kernel time without launch cost),
with the largest difference to cuBLAS's output. The last column sums a layer's matmuls with the faster of the
two per shape: what a decode step would save.

The kernel (below) splits the reduction over programs, each writing an fp32 partial that a second kernel
sums, so that an output of 14 tiles still spreads over every SM. Measured 2026-11-26 on one H100: cuBLAS is
as fast or faster at every shape (docs/benchmarks.md), so the engine keeps F.linear; the script stays as the
record and to re-check on other GPUs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from engine_profile import graph_ms  # bench/ is the script's folder, so on sys.path

try:
    import triton
    import triton.language as tl
except ImportError:  # the benchmark needs a GPU anyway
    triton = None


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4

    def fits(self, k: int) -> bool:
        """The kernel has no mask along K: every split must cover whole K tiles."""
        return k % self.block_k == 0


if triton is not None:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        k_tiles = K // BLOCK_K
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        first = pid_k * per_split
        last = tl.minimum(first + per_split, k_tiles)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * K + (first * BLOCK_K + offs_k)[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (first * BLOCK_K + offs_k)[None, :]
        row_ok = offs_m[:, None] < M
        col_ok = offs_n[:, None] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(first, last):
            a = tl.load(x_ptrs, mask=row_ok, other=0.0)
            b = tl.load(w_ptrs, mask=col_ok, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        out_offs = offs_m[:, None] * N + offs_n[None, :]
        if SPLIT_K == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + out_offs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(ws_ptr + pid_k * M * N + out_offs, acc, mask=out_mask)

    @triton.jit
    def _split_sum_kernel(ws_ptr, bias_ptr, y_ptr, M, N, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                          BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < M * N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(ws_ptr + s * M * N + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: LinearConfig,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N] in x's dtype, on CUDA. Both inputs contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    if not config.fits(k):
        raise ValueError(f"K={k} is not a multiple of block_k={config.block_k}")
    y = out if out is not None else torch.empty(m, n, device=x.device, dtype=x.dtype)
    split = config.split_k
    ws = torch.empty(split, m, n, device=x.device, dtype=torch.float32) if split > 1 else y
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    has_bias = bias is not None
    _linear_kernel[grid](x, weight, bias if has_bias else y, y, ws, m, n, k, HAS_BIAS=has_bias,
                         BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
                         num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, block),)](ws, bias if has_bias else y, y, m, n, HAS_BIAS=has_bias,
                                                         SPLIT_K=split, BLOCK=block, num_warps=4)
    return y


def candidate_configs(m: int, k: int) -> list[LinearConfig]:
    """Configs worth timing at M rows and reduction K: tiles no taller than needed, splits that leave each
    program at least two K tiles, 4 warps on 64-row tiles and 8 on 128-row ones (a small set: each distinct
    config is one Triton compile)."""
    out = []
    for block_m in (64, 128):
        if block_m > 64 and m <= 64:
            continue
        for block_n in (64, 128):
            for block_k, stages in ((64, 4), (128, 3)):
                for split in (1, 2, 4, 8):
                    if k % block_k or (k // block_k) < split * 2:
                        continue
                    out.append(LinearConfig(block_m, block_n, block_k, split, 4 if block_m == 64 else 8, stages))
    return out


ARCH = {  # hidden, intermediate, heads, kv heads, head dim, vocab
    "0.5B": (896, 4864, 14, 2, 64, 151936),
    "1.5B": (1536, 8960, 12, 2, 128, 151936),
}


def shapes(arch: str) -> dict[str, tuple[int, int, bool]]:
    h, inter, heads, kv, hd, _ = ARCH[arch]
    return {"qkv": (h, (heads + 2 * kv) * hd, True), "o_proj": (heads * hd, h, False),
            "gate_up": (h, 2 * inter, False), "down": (inter, h, False)}


def time_shape(m: int, k: int, n: int, bias: bool) -> tuple[float, float, LinearConfig | None, float]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = F.linear(x, w, b)
    cublas = graph_ms(lambda: F.linear(x, w, b)) * 1000
    best, best_cfg, err = float("inf"), None, 0.0
    for cfg in candidate_configs(m, k):
        out = linear(x, w, b, cfg)
        diff = (out.float() - ref.float()).abs().max().item()
        if diff > 0.05:
            print(f"  config {cfg} differs from cuBLAS by {diff:.3g}: skipped")
            continue
        us = graph_ms(lambda c=cfg: linear(x, w, b, c)) * 1000
        if us < best:
            best, best_cfg, err = us, cfg, diff
    return cublas, best, best_cfg, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 128, 64])
    p.add_argument("--arch", nargs="+", default=list(ARCH))
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for arch in args.arch:
        for m in args.rows:
            print(f"\n{arch}, M = {m}\n| matmul | K x N | cuBLAS us | Triton us | best config | max diff |\n"
                  "| --- | --- | ---: | ---: | --- | ---: |")
            layer_cublas = layer_best = 0.0
            for name, (k, n, bias) in shapes(arch).items():
                cublas, best, cfg, err = time_shape(m, k, n, bias)
                layer_cublas += cublas
                layer_best += min(cublas, best)
                tag = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} split {cfg.split_k} w{cfg.num_warps} "
                       f"s{cfg.num_stages}") if cfg else "-"
                print(f"| {name} | {k} x {n} | {cublas:.1f} | {best:.1f} | {tag} | {err:.2g} |", flush=True)
            print(f"layer: cuBLAS {layer_cublas:.1f} us, faster-of-two {layer_best:.1f} us "
                  f"({100 * (1 - layer_best / layer_cublas):.0f}% less)")


if __name__ == "__main__":
    main()

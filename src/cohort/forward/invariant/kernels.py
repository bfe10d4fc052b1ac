"""Batch-invariant Triton kernels: matmul, RMSNorm, the SiLU and GELU-tanh gates, the chosen token's log-softmax.

Each output row is computed by code that never looks at the other rows, in an order fixed by constants:

- `linear(x, w, bias)` = x @ w^T (+ bias): tiles of LINEAR_TILES (M, N, K), one program per output tile, the K
  loop from 0 to K in steps of the K tile, accumulating in float32 in the tile's registers, rounded once to the
  output dtype. No split-K and no tile chosen by M (cuBLAS picks both by M: a decode row of 256 and the same row
  in an 8k-token training row get different kernels and different sums). M is not specialised by Triton
  (`do_not_specialize`), so one compiled kernel serves every M, and a row's value is the same in any batch, at
  any place in it. A column's value does not depend on the other columns either, so fused and separate
  projections give the same bits.
- `rms_norm(x, w, eps)`: one program per row, the row's sum of squares in one block reduction (the block is the
  hidden size rounded up to a power of two), HF's rounding points (normalise in float32, round, times weight);
  with `offset=True` Gemma's (normalise and scale by 1 + weight in float32, round once).
- `silu_mul(gate, up)`: elementwise, silu rounded to the dtype then times up (F.silu(gate) * up in the dtype);
  `gelu_tanh_mul` the same with Gemma's tanh-approximated GELU.
- `token_logprobs(logits, labels, inv_temp)`: per row, log_softmax(logits * inv_temp)[label] and the log-sum-exp,
  the vocabulary walked in blocks of LOGPROB_BLOCK from column 0 (a running maximum and a rescaled sum, as
  forward/triton_logprobs does); the engine's sampler slices the vocabulary by the batch's row count instead.

The engine calls these in decode (M = the batch), in prefill (M = the step's prompt tokens) and the trainer in
its packed rows (M = thousands of tokens): the same kernels, the same tiles, so the same bits. Without Triton
(CPU installs) the module imports and `available()` is False; TRITON_INTERPRET=1 runs them on the CPU (tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: exact parity needs Triton
    triton = None
    tl = None

# (M, N, K) tile of the matmul and its launch. Fixed for every M: changing one changes the values of every row
# (that is a different kernel, not a batch effect), so the engine and the trainer must use the same constants.
LINEAR_TILES = (64, 64, 64)
LINEAR_WARPS = 4
LINEAR_STAGES = 3
LOGPROB_BLOCK = 4096  # vocabulary columns per step of the log-softmax
ELEMENT_BLOCK = 1024  # elements per program of silu_mul


def available(device: torch.device | None = None) -> bool:
    """Whether the kernels can run: Triton installed, and a CUDA device (or the interpreter, for CPU tests)."""
    if triton is None:
        return False
    if device is not None and torch.device(device).type != "cuda":
        return os.environ.get("TRITON_INTERPRET") == "1"
    return True


# Triton 3.6's interpreter multiplies bfloat16 tiles wrongly in tl.dot (numbers of 1e10 for products of unit
# normals): under it the kernels multiply float32 copies (bfloat16 products are exact in float32).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _precision(dtype: torch.dtype) -> str:
    # float32 models get exact float32 products (not tf32): the same choice in every caller
    return "ieee" if dtype == torch.float32 or INTERPRETED else "tf32"


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < K
            a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr,
                         OFFSET: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(x * x, 0) / N
        h = x * (1.0 / tl.sqrt(var + eps))
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:  # noqa: SIM108 (a constexpr if: Triton compiles one branch) Gemma: h * (1 + w) in float32, once rounded
            y = h * (1.0 + w)
        else:  # Llama: h rounded to the dtype, then times w
            y = w * h.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _gate_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = idx < n
        g = tl.load(g_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        if GELU_TANH:  # 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (exp(2y) + 1)
            y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        else:  # SiLU
            a = g / (1.0 + tl.exp(-g))
        s = a.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + idx, (s * u).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _token_logprob_kernel(logits_ptr, labels_ptr, inv_t_ptr, chosen_ptr, lse_ptr, stride, vocab,
                              BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        inv_t = tl.load(inv_t_ptr + row)
        cols = tl.arange(0, BLOCK)
        base = logits_ptr + row * stride
        m = float("-inf")
        total = 0.0
        for start in range(0, vocab, BLOCK):
            idx = start + cols
            z = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
            new_m = tl.maximum(m, tl.max(z, 0))
            safe = tl.where(new_m > float("-inf"), new_m, 0.0)
            total = total * tl.exp(m - safe) + tl.sum(tl.exp(z - safe), 0)
            m = new_m
        lse = m + tl.log(total)
        label = tl.load(labels_ptr + row)
        chosen = tl.load(base + label).to(tl.float32) * inv_t
        tl.store(chosen_ptr + row, chosen - lse)
        tl.store(lse_ptr + row, lse)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) in x's dtype, each row independent of the others (see the module)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = x2.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = LINEAR_TILES
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    if m:
        _linear_kernel[grid](x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0),
                             weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=bk, PRECISION=_precision(x.dtype), UPCAST=INTERPRETED,
                             num_warps=LINEAR_WARPS,
                             num_stages=LINEAR_STAGES)
    return out.view(*shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """HF RMSNorm (float32 statistics, rounded, times weight) over the last dimension, one row per program;
    offset: Gemma's (times 1 + weight in float32, then rounded)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), x2.shape[1], float(eps),
                                         BLOCK=triton.next_power_of_2(x2.shape[1]), OFFSET=offset)
    return out.view(shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in the inputs' dtype, elementwise."""
    return _gate_mul(gate, up, gelu_tanh=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up in the inputs' dtype, elementwise (Gemma's MLP)."""
    return _gate_mul(gate, up, gelu_tanh=True)


def _gate_mul(gate: torch.Tensor, up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _gate_mul_kernel[(triton.cdiv(n, ELEMENT_BLOCK),)](gate, up, out, n, BLOCK=ELEMENT_BLOCK, GELU_TANH=gelu_tanh)
    return out


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                   inv_temp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits * inv_temp)[label], logsumexp(logits * inv_temp)) per row, float32 [R] each.
    logits [R, V] (the LM head's output in the model's dtype), labels [R] int, inv_temp [R] float32."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chosen = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _token_logprob_kernel[(rows,)](logits, labels.contiguous(), inv_temp.float().contiguous(), chosen, lse,
                                       logits.stride(0), vocab, BLOCK=LOGPROB_BLOCK)
    return chosen, lse

"""The batch-invariant kernels as differentiable ops: the kernel's value forward, torch's usual maths backward.

Parity needs the forward values only (the engine's sampling log-probabilities against the trainer's forward of the
same tokens); the gradients may come from any correct formula. So each op's forward is the kernel's and its
backward is the plain one: the matmul's two products with the incoming gradient (cuBLAS), and for RMSNorm, the
SiLU and GELU-tanh gates and attention the gradient of a PyTorch reference recomputed in the backward (attention through flash
varlen on a GPU in half precision, SDPA per segment elsewhere). Under no_grad or inference_mode (the engine, the
old-logprob pass) they are the kernels and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cohort.forward.invariant import attention, kernels
from cohort.forward.packed_attention import _flash_eligible, _flash_varlen


def _rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:  # Gemma
        return (h * (1.0 + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def _silu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gelu_tanh_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernels.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = (g2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class _Recomputed(torch.autograd.Function):
    """forward: `kernel(*tensors)`; backward: the vector-Jacobian product of `reference(*tensors)`, recomputed."""

    @staticmethod
    def forward(ctx, kernel: Callable, reference: Callable, *tensors):
        ctx.reference = reference
        ctx.save_for_backward(*tensors)
        return kernel(*tensors)

    @staticmethod
    def backward(ctx, grad):
        tensors = ctx.saved_tensors
        wanted = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(w) for t, w in zip(tensors, wanted, strict=True)]
            out = ctx.reference(*inputs)
            chosen = [t for t, w in zip(inputs, wanted, strict=True) if w]
            grads = iter(torch.autograd.grad(out, chosen, grad) if chosen else ())
        return (None, None, *(next(grads) if w else None for w in wanted))


def _needs_graph(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if _needs_graph(x, weight, bias):
        return _Linear.apply(x, weight, bias)
    return kernels.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False) -> torch.Tensor:
    """offset: Gemma's RMSNorm (times 1 + weight)."""
    if _needs_graph(x, weight):
        return _Recomputed.apply(lambda a, w: kernels.rms_norm(a, w, eps, offset),
                                 lambda a, w: _rms_reference(a, w, eps, offset), x, weight)
    return kernels.rms_norm(x, weight, eps, offset)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _needs_graph(gate, up):
        return _Recomputed.apply(kernels.silu_mul, _silu_reference, gate, up)
    return kernels.silu_mul(gate, up)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if _needs_graph(gate, up):
        return _Recomputed.apply(kernels.gelu_tanh_mul, _gelu_tanh_reference, gate, up)
    return kernels.gelu_tanh_mul(gate, up)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor,
                     cu: torch.Tensor, max_len: int, scale: float, window: int | None) -> torch.Tensor:
    """attention.attend_packed with a backward: q [T, H, D], k/v [T, Hkv, D]; cu the row's segment bounds."""

    def kernel(q_, k_, v_):
        return attention.attend_packed(q_, k_, v_, starts, positions, scale, max_len, window)

    if not _needs_graph(q, k, v):
        return kernel(q, k, v)

    def reference(q_, k_, v_):
        if _flash_eligible(q_):
            cu32 = cu.to(torch.int32)
            return _flash_varlen(q_, k_, v_, cu32, cu32, max_len, max_len, scale, window)
        return attention.reference(q_, k_, v_, cu.tolist(), scale, window)

    return _Recomputed.apply(kernel, reference, q, k, v)

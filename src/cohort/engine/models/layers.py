"""Elementwise pieces of the decoder forward, written to be fused by torch.compile on the GPU.

A decode step of a small model at batch 256 is dominated by kernel count, not bytes: HF's RMSNorm alone is
seven kernels, RoPE about eight. These functions compute the same thing as the HF modules (RMSNorm in
float32, the residual add in the model dtype, SiLU-gate in the model dtype) and `fused_ops(device)` returns
torch.compile'd versions on CUDA (one kernel each) and the plain functions elsewhere (CPU tests).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then RMSNorm: returns (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF apply_rotary_pos_emb on [T, heads, D] tensors with per-token cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# Distinct graphs a process may hold per compiled op: (dtype, rank, last-dim width, size-1 pattern) of every model
# the process builds an engine for; dynamo's default of 8 is hit by a GPU test session of several families.
RECOMPILE_LIMIT = 64


def compile_shape_generic(fn, weights: tuple[int, ...] = (), backend="inductor"):
    """torch.compile `fn` (dynamic, fullgraph) so that one graph serves every batch size of a model.

    The leading dimensions (tokens, heads) stay dynamic: graph capture calls the ops at 20 batch sizes and
    every one reuses the graph (dynamo still specialises a size of 1: a decode batch of one, Gemma 3's
    single KV head). The last dimension (hidden size, head dim) is marked static: it is the reduction and
    vector width of the kernels, and a symbolic width turns the norms into looped reductions (measured
    on the 0.5B decode benchmark: 82k tok/s with it symbolic, 104k static). The arguments at `weights` are
    passed detached, so a parameter's requires_grad is not a guard. What remains is one graph per dtype,
    rank, width and size-1 pattern, so the recompile limit is raised to RECOMPILE_LIMIT (a process running
    engines of several model families holds a few dozen). (`backend` is for the CPU test of the guards.)
    """
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, RECOMPILE_LIMIT)
    mark_static = torch._dynamo.decorators.mark_static

    @functools.wraps(fn)
    def call(*args):
        args = tuple(a.detach() if i in weights else a for i, a in enumerate(args))
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                mark_static(a, a.dim() - 1)
        return compiled(*args)

    call.compiled = compiled  # type: ignore[attr-defined]
    return call


class FusedOps:
    def __init__(self, compile_: bool) -> None:
        wrap = compile_shape_generic if compile_ else (lambda f, weights=(): f)
        self.rms_norm = wrap(rms_norm, weights=(1,))
        self.add_rms_norm = wrap(add_rms_norm, weights=(2,))
        self.rope = wrap(rope)
        self.silu_mul = wrap(silu_mul)
        self.compiled = compile_


def fused_ops(device: torch.device) -> FusedOps:
    return FusedOps(compile_=device.type == "cuda")

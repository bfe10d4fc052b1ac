"""FlashAttention-4's varlen attention as torch custom ops (`model.packed_attention=fa4`).

FA4 (`flash-attn-4`, `flash_attn.cute`) launches CuTe DSL kernels from Python, which torch.compile cannot
trace: called directly inside a compiled decoder layer, it splits the layer's graph in two around the
attention (measured on an H100: the step no faster than torch's FlashAttention-2 despite 35% faster
kernels). Wrapped here as two opaque custom ops, a forward returning (out, lse) and a backward returning
(dq, dk, dv), with fake implementations that give their output shapes, the compiled layer keeps one graph
and calls FA4's kernels from inside it. Tensors are [total tokens, heads, head size], the packed sequences
marked by `cu_seqlens` (int32); KV heads may be fewer than query heads (grouped in the kernel). Keys may have
their own segments (`cu_k`: a shared-prompt row, cohort.forward.shared_prompts); a shorter query segment is aligned to
the end of its key segment, FlashAttention's causal convention.

The ops call FA4's `_flash_attn_fwd` / `_flash_attn_bwd` (flash-attn-4 4.0.0b36's interface, the same calls
its own autograd function makes), with causal masking and an optional sliding window of W keys
(`window_left` = W - 1; -1: none).
"""

from __future__ import annotations

import torch


def _window(window_left: int) -> int | None:
    return None if window_left < 0 else window_left


@torch.library.custom_op("cohort::fa4_varlen_fwd", mutates_args=())
def fa4_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                   scale: float, window_left: int, cu_k: torch.Tensor, max_len_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_fwd  # type: ignore[import-not-found]  # optional dependency: FA4

    # return_lse: the op's inputs never require grad, and FA4 only keeps the log-sum-exp the backward needs
    # when they do or when asked
    res = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_k, max_seqlen_q=max_len,
                          max_seqlen_k=max_len_k, softmax_scale=scale, causal=True,
                          window_size_left=_window(window_left), window_size_right=0, return_lse=True)
    return res[0], res[1]


@fa4_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_len, scale, window_left, cu_k, max_len_k):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)  # FA4's varlen layout: [heads, tokens]
    return out, lse


@torch.library.custom_op("cohort::fa4_varlen_bwd", mutates_args=())
def fa4_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, scale: float,
                   window_left: int, cu_k: torch.Tensor, max_len_k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd  # optional dependency: FA4

    res = _flash_attn_bwd(q, k, v, out, dout, lse, scale, True, 0.0, window_size_left=_window(window_left),
                          window_size_right=0, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_k,
                          max_seqlen_q=max_len, max_seqlen_k=max_len_k)
    return res[0], res[1], res[2]


@fa4_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_len, scale, window_left, cu_k, max_len_k):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_len, scale, window_left, cu_k, max_len_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, cu_k)
    ctx.max_len, ctx.scale, ctx.window_left, ctx.max_len_k = max_len, scale, window_left, max_len_k


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens, cu_k = ctx.saved_tensors
    dq, dk, dv = fa4_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_len, ctx.scale,
                                ctx.window_left, cu_k, ctx.max_len_k)
    return dq, dk, dv, None, None, None, None, None, None


fa4_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_varlen(query, key, value, cu_seqlens, max_len: int, scaling: float, window: int | None = None, *,
               cu_k: torch.Tensor | None = None, max_len_k: int | None = None):
    """Causal varlen attention through FA4 on [T, H, D] tensors; window W: each query sees its own and the
    W - 1 previous keys. cu_k / max_len_k: key segments of their own (default: the query's). Differentiable,
    and traceable by torch.compile as one opaque op."""
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out, _ = fa4_varlen_fwd(_unit_stride(query), _unit_stride(key), _unit_stride(value), cu_seqlens, int(max_len),
                            scale, -1 if window is None else int(window) - 1,
                            cu_seqlens if cu_k is None else cu_k, int(max_len if max_len_k is None else max_len_k))
    return out


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """FA4 reads any token and head strides but needs the head dimension contiguous (as its own entry point)."""
    return t if t.stride(-1) == 1 else t.contiguous()

"""One GEMM for the query, key and value projections of the packed training forward.

Hugging Face attention modules project the hidden states three times (`q_proj`, `k_proj`, `v_proj`). With
grouped KV heads the key and value projections are narrow (Qwen2.5-0.5B: 896 -> 128), and narrow GEMMs run
far below the GPU's rate in all three of their passes (forward, input gradient, weight gradient). One GEMM over
the concatenated weights does the same arithmetic: q, k, v forward + backward on an H100, 34,816 tokens,
0.897 -> 0.590 ms a layer (`bench/update_kernels.py`), about 15 ms of a 0.5B bench update. (Gate and up are
wide already; one GEMM for them was slower there, 2.72 -> 3.25 ms, so the MLP is left as it is.)

`fuse_qkv_projections(model)` gives each supported attention module a forward that, inside a packed forward
(`cohort.packed_attention`'s cu_seq_lens path), concatenates the three weights (and biases) for one
`F.linear`, splits the result, and then does what the family's own forward does: per-head norms (Qwen3),
rotary embedding, the packed attention with the family's sliding window, and `o_proj`. Every other call
(generate, ordinary forwards) runs the module's own forward. The parameters stay the model's own, so
checkpoints, the optimizer, LoRA and the rollout engine (which reads the weights in place) see no change.

Each module is checked once against its own forward on a small packed input before the fused forward is kept;
a module whose outputs differ (a transformers version whose forward does something this one does not) keeps
its own forward, and a warning says so. Families: Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral; modules whose
projections are not plain `nn.Linear` (LoRA-wrapped, quantised) are left alone. `COHORT_FUSED_QKV=0` in the
environment keeps every module's own forward (for A/B measurements).
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import torch
import torch.nn.functional as F

from cohort.packed_attention import VARLEN_IMPL, enable_packed_attention, varlen_attention_forward

# attention class -> where its forward takes the sliding window from: the module's attribute, the config's,
# or nowhere (Llama passes none)
SLIDING_WINDOW_FROM = {
    "LlamaAttention": None,
    "Qwen2Attention": "module",
    "Qwen3Attention": "module",
    "Qwen3MoeAttention": "module",
    "MistralAttention": "config",
}
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache")


def _sliding_window(module):
    source = SLIDING_WINDOW_FROM[type(module).__name__]
    if source == "module":
        return getattr(module, "sliding_window", None)
    if source == "config":
        return getattr(module.config, "sliding_window", None)
    return None


def _fused_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The attention module's forward with one q/k/v GEMM inside a packed forward; its own forward otherwise.
    (Traced by torch.compile inside a compiled decoder layer: what it needs of the family was looked up when it
    was installed.)"""
    cached = any(kwargs.get(k) is not None for k in _CACHE_KWARGS)
    if (kwargs.get("cu_seq_lens_q") is None or cached or position_embeddings is None
            or self.config._attn_implementation != VARLEN_IMPL):
        return self._cohort_own_forward(hidden_states, position_embeddings=position_embeddings,
                                        attention_mask=attention_mask, **kwargs)
    q_proj, k_proj, v_proj = self.q_proj, self.k_proj, self.v_proj
    weight = torch.cat([q_proj.weight, k_proj.weight, v_proj.weight])
    bias = None if q_proj.bias is None else torch.cat([q_proj.bias, k_proj.bias, v_proj.bias])
    q, k, v = F.linear(hidden_states, weight, bias).split(
        [q_proj.out_features, k_proj.out_features, v_proj.out_features], dim=-1)
    input_shape = hidden_states.shape[:-1]
    shape = (*input_shape, -1, self.head_dim)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    if getattr(self, "q_norm", None) is not None:  # Qwen3: RMSNorm over each head, before the rotary embedding
        q, k = self.q_norm(q), self.k_norm(k)
    # The rotary embedding in the [.., tokens, heads, head size] layout of the GEMM's output (cos and sin
    # broadcast over the heads), then the attention function's [.., heads, tokens, head size] view. In the
    # heads-first layout the compiled backward wrote the concatenated q/k/v gradient token by token across
    # heads: 396 us a layer for a 34,816-token micro-batch against 32 us for the separate projections.
    cos, sin = position_embeddings
    q, k = self._cohort_rope(q, k, cos, sin, unsqueeze_dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    for key in _CACHE_KWARGS:
        kwargs.pop(key, None)
    out, weights = varlen_attention_forward(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, sliding_window=self._cohort_sliding_window, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _plain_projections(module) -> bool:
    projections = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(type(p) is torch.nn.Linear for p in projections):  # LoRA or quantised layers: leave them
        return False
    q, k, v = (module.q_proj, module.k_proj, module.v_proj)
    same_bias = (q.bias is None) == (k.bias is None) == (v.bias is None)
    # sharded (FSDP) weights are DTensors outside the forward: not handled here
    return (same_bias and q.in_features == k.in_features == v.in_features
            and q.weight.dtype == k.weight.dtype == v.weight.dtype and type(q.weight).__name__ != "DTensor")


def _agrees_with_own_forward(module) -> bool:
    """The fused forward against the module's own on 2 packed sequences of random hidden states (no grad)."""
    weight = module.q_proj.weight
    gen = torch.Generator(device=weight.device).manual_seed(0)
    hidden = torch.randn(1, 12, module.q_proj.in_features, device=weight.device, generator=gen).to(weight.dtype)
    angles = torch.rand(1, 12, module.head_dim, device=weight.device, generator=gen) * 6.3
    cos, sin = angles.cos().to(weight.dtype), angles.sin().to(weight.dtype)
    cu = torch.tensor([0, 5, 12], device=weight.device, dtype=torch.int32)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7,
              "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]], device=weight.device)}
    try:
        with torch.no_grad():
            want = module._cohort_own_forward(hidden, position_embeddings=(cos, sin), attention_mask=None, **kwargs)[0]
            got = _fused_forward(module, hidden, position_embeddings=(cos, sin), attention_mask=None, **kwargs)[0]
    except Exception as exc:  # a forward signature this code does not know: keep the module's own
        warnings.warn(f"fused q/k/v projections: {type(module).__name__}'s check failed ({exc!r:.200}); it keeps "
                      "its own forward", stacklevel=3)
        return False
    tol = 1e-4 if weight.dtype == torch.float32 else 3e-2
    return want.shape == got.shape and torch.allclose(want.float(), got.float(), atol=tol, rtol=tol)


def fuse_qkv_projections(model) -> int:
    """Give every supported attention module of `model` the fused forward (idempotent); returns how many
    modules have it. The model's attention must already route through cohort.packed_attention for the check."""
    if os.environ.get("COHORT_FUSED_QKV", "1") == "0":  # A/B measurements and debugging: the three projections
        return 0
    enable_packed_attention(model)
    fused = 0
    warned = False
    for module in model.modules():
        if type(module).__name__ not in SLIDING_WINDOW_FROM or not _plain_projections(module):
            continue
        if getattr(module, "_cohort_own_forward", None) is not None:
            fused += 1
            continue
        if module.config._attn_implementation != VARLEN_IMPL:
            continue
        if "forward" in vars(module):  # a forward set on the instance by someone else: leave it
            continue
        module._cohort_own_forward = module.forward
        module._cohort_rope = sys.modules[type(module).__module__].apply_rotary_pos_emb  # the family's own
        module._cohort_sliding_window = _sliding_window(module)
        module.forward = types.MethodType(_fused_forward, module)
        if _agrees_with_own_forward(module):
            fused += 1
            continue
        del module.forward  # the class's forward again
        del module._cohort_own_forward, module._cohort_rope, module._cohort_sliding_window
        if not warned:
            warned = True
            warnings.warn(f"fused q/k/v projections: {type(module).__name__}'s fused forward differs from its own "
                          "on a check input; those modules keep their own forward (three projection GEMMs)",
                          stacklevel=2)
    return fused

"""The one decoder forward of exact parity, run by the engine and by the training forward: the Llama family
(Llama, Mistral, Qwen2, Qwen3) and Gemma 3 text models.

Both sides call `InvariantDecoder.hidden` on their packed tokens; they differ only in the attention callback (the
engine stores the step's K/V in its paged cache and attends through the block tables, the trainer attends over
its packed row) and both callbacks run the same kernel (attention.py). So every rounding point is the same on the
two sides: separate Q, K and V projections (the engine's fused QKV and gate-up copies are not used; with these
kernels they would give the same bits anyway), RMSNorm in float32 rounded to the dtype then times weight, RoPE in
the dtype from one table of cos/sin per position, the residual adds in the dtype, SiLU rounded before the gate
product. The model's modules are reached by name (`q_proj`, `input_layernorm`, ...): the trained weights are
read in place, nothing is copied after an optimizer step.

Gemma 3 (`gemma3_text`) differs where transformers' modeling_gemma3 does: RMSNorm times (1 + weight) in float32
with one rounding, four norms per layer (the attention's and the MLP's outputs are normed before their residual
adds), a GELU-tanh gate, the embedding module's sqrt(hidden) scale, and one RoPE table per layer type (local
layers with their own base and sliding window, global layers with theirs). Soft-capped logits and bidirectional
attention are refused (Gemma 3 sets neither).

RoPE tables: `rope_table` computes positions in blocks of ROPE_BLOCK with the model's own rotary module (every
static RoPE variant), each block by a call of the same shape, so a position's cos/sin are the same bits whatever
the table's length (a CPU's vectorised cos treats a table's tail elements apart). The tables are stacked
[layer types, positions, head_dim] (one layer type for the Llama family); `InvariantDecoder.tables[i]` is layer
i's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cohort.forward.invariant import ops

EXACT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
GEMMA = "gemma3_text"
_DYNAMIC_ROPE = ("dynamic", "longrope")
ROPE_BLOCK = 256
_MISSING = object()

# (layer index, q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], window) -> [T, H, D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]


def causal_lm(model: nn.Module) -> Any:
    """The *ForCausalLM inside a PEFT wrapper (duck-typed: its parts are reached by name)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def unsupported(model: nn.Module) -> str | None:
    """Why exact parity cannot run `model` (None: it can)."""
    hf = causal_lm(model)
    config = hf.config
    kind = getattr(config, "model_type", None)
    if kind not in EXACT_MODEL_TYPES:
        return (f"model_type {kind!r} has no batch-invariant forward yet (exact parity runs "
                f"{', '.join(EXACT_MODEL_TYPES)}; the mixture-of-experts families remain)")
    reason = _gemma_unsupported(config) if kind == GEMMA else None
    if reason is not None:
        return reason
    if kind != GEMMA and getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r}: the batch-invariant MLP is SiLU-gated"
    if any(rope_type in _DYNAMIC_ROPE for rope_type in _rope_types(config)):
        return "RoPE that changes with the sequence length (dynamic, longrope) has no fixed table"
    for layer in hf.model.layers:
        names = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in names):
            return ("a projection is not a plain nn.Linear (LoRA adapters or a quantised layer): the batch-invariant "
                    "forward multiplies the weights itself")
    return None


def _gemma_unsupported(config: Any) -> str | None:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"hidden_activation={act!r}: the batch-invariant Gemma MLP is GELU-tanh-gated"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"{name}={getattr(config, name)}: soft-capped logits have no batch-invariant kernel"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True: the batch-invariant attention is causal"
    return None


def _rope_types(config: Any) -> list[str | None]:
    """The RoPE types a config uses (Gemma 3: one per layer type, in rope_parameters keyed by layer type)."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return []
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return [v.get("rope_type", v.get("type")) for v in rope.values()]
    return [rope.get("rope_type", rope.get("type"))]


def rope_layer_types(hf: Any) -> list[str | None]:
    """The distinct RoPE tables a model needs: its config's layer types (Gemma 3), else one (None)."""
    if getattr(hf.config, "model_type", None) == GEMMA:
        return sorted(set(hf.config.layer_types))
    return [None]


def layer_windows(hf: Any) -> list[int | None]:
    """Each layer's sliding window, as the HF modeling code applies it (the attention module's own, else the
    config's, which Mistral reads for every layer)."""
    windows: list[int | None] = []
    for layer in hf.model.layers:
        window: Any = getattr(layer.self_attn, "sliding_window", _MISSING)
        if window is _MISSING:
            window = getattr(hf.config, "sliding_window", None)
        windows.append(int(window) if window else None)
    return windows


@torch.no_grad()
def rope_table(model: nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [layer types, >= length, head_dim] in the model's dtype, block by block (see the module)."""
    hf = causal_lm(model)
    inner = hf.model
    weight = inner.embed_tokens.weight
    probe = torch.zeros(1, device=weight.device, dtype=weight.dtype)
    blocks = max(1, -(-length // ROPE_BLOCK))
    tables_cos, tables_sin = [], []
    for layer_type in rope_layer_types(hf):
        extra = () if layer_type is None else (layer_type,)
        cos, sin = [], []
        for b in range(blocks):
            positions = torch.arange(b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK, device=weight.device)[None, :]
            c, s = inner.rotary_emb(probe, positions, *extra)
            cos.append(c[0])
            sin.append(s[0])
        tables_cos.append(torch.cat(cos))
        tables_sin.append(torch.cat(sin))
    return torch.stack(tables_cos).contiguous(), torch.stack(tables_sin).contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF apply_rotary_pos_emb on [T, heads, D] with per-token cos/sin [T, D], elementwise in the dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class InvariantDecoder:
    """The batch-invariant forward of one Llama-family or Gemma 3 *ForCausalLM (its modules read in place)."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"generation.logprob_parity=exact: {reason}")
        hf = causal_lm(model)
        config = hf.config
        self.hf, self.inner = hf, hf.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        first = self.inner.layers[0].self_attn
        self.scale = float(getattr(first, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(first, "q_norm")
        self.windows = layer_windows(hf)
        self.gemma = getattr(config, "model_type", None) == GEMMA
        types = rope_layer_types(hf)
        self.tables = [types.index(t) for t in config.layer_types] if self.gemma else [0] * len(self.inner.layers)
        self._gate = ops.gelu_tanh_mul if self.gemma else ops.silu_mul

    def hidden(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """input_ids [T]; cos/sin [layer types, T, D] (rope_table rows of the tokens' positions) -> final normed
        hidden [T, d]."""
        x = self.inner.embed_tokens(input_ids)  # Gemma's module multiplies by sqrt(hidden) itself
        for i, layer in enumerate(self.inner.layers):
            t = self.tables[i]
            delta = self._attention(i, layer, self._norm(x, layer.input_layernorm), cos[t], sin[t], attend)
            if self.gemma:  # the output normed before the residual add, then the MLP's own input norm
                x = x + self._norm(delta, layer.post_attention_layernorm)
                h = self._norm(x, layer.pre_feedforward_layernorm)
            else:
                x = x + delta
                h = self._norm(x, layer.post_attention_layernorm)
            delta = self._mlp(layer.mlp, h)
            x = x + (self._norm(delta, layer.post_feedforward_layernorm) if self.gemma else delta)
        return self._norm(x, self.inner.norm)

    def _mlp(self, mlp: Any, h: torch.Tensor) -> torch.Tensor:
        return self._linear(self._gate(self._linear(h, mlp.gate_proj), self._linear(h, mlp.up_proj)), mlp.down_proj)

    def _attention(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend: Attend) -> torch.Tensor:
        attn = layer.self_attn
        tokens = h.shape[0]
        q = self._linear(h, attn.q_proj).view(tokens, self.num_heads, self.head_dim)
        k = self._linear(h, attn.k_proj).view(tokens, self.num_kv_heads, self.head_dim)
        v = self._linear(h, attn.v_proj).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3, Gemma 3: RMSNorm of each head's query and key
            q, k = self._norm(q, attn.q_norm), self._norm(k, attn.k_norm)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = attend(i, q, k, v, self.windows[i])
        return self._linear(o.reshape(tokens, self.num_heads * self.head_dim), attn.o_proj)

    @staticmethod
    def _linear(x: torch.Tensor, module: Any) -> torch.Tensor:
        return ops.linear(x, module.weight, module.bias)

    def _norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        if self.gemma:  # Gemma3RMSNorm: eps, times (1 + weight)
            return ops.rms_norm(x, norm.weight, norm.eps, offset=True)
        return ops.rms_norm(x, norm.weight, norm.variance_epsilon)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM-head logits [R, V] in the model's dtype by the batch-invariant matmul (the engine's sampling rows)."""
        head = self.hf.lm_head
        return ops.kernels.linear(hidden, head.weight, head.bias, out=out)

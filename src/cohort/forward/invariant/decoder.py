"""The one Llama-family decoder forward of exact parity, run by the engine and by the training forward.

Both sides call `InvariantDecoder.hidden` on their packed tokens; they differ only in the attention callback (the
engine stores the step's K/V in its paged cache and attends through the block tables, the trainer attends over
its packed row) and both callbacks run the same kernel (attention.py). So every rounding point is the same on the
two sides: separate Q, K and V projections (the engine's fused QKV and gate-up copies are not used; with these
kernels they would give the same bits anyway), RMSNorm in float32 rounded to the dtype then times weight, RoPE in
the dtype from one table of cos/sin per position, the residual adds in the dtype, SiLU rounded before the gate
product. The model's modules are reached by name (`q_proj`, `input_layernorm`, ...): the trained weights are
read in place, nothing is copied after an optimizer step.

RoPE tables: `rope_table` computes positions in blocks of ROPE_BLOCK with the model's own rotary module (every
static RoPE variant), each block by a call of the same shape, so a position's cos/sin are the same bits whatever
the table's length (a CPU's vectorised cos treats a table's tail elements apart).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cohort.forward.invariant import ops

EXACT_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
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
                f"{', '.join(EXACT_MODEL_TYPES)}; Gemma 3 and the mixture-of-experts families remain)")
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act={config.hidden_act!r}: the batch-invariant MLP is SiLU-gated"
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("dynamic", "longrope"):
        return "RoPE that changes with the sequence length (dynamic, longrope) has no fixed table"
    for layer in hf.model.layers:
        names = [getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [getattr(layer.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not nn.Linear for m in names):
            return ("a projection is not a plain nn.Linear (LoRA adapters or a quantised layer): the batch-invariant "
                    "forward multiplies the weights itself")
    return None


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
    """(cos, sin) [>= length, head_dim] in the model's dtype, block by block (see the module)."""
    inner = causal_lm(model).model
    weight = inner.embed_tokens.weight
    probe = torch.zeros(1, device=weight.device, dtype=weight.dtype)
    blocks = max(1, -(-length // ROPE_BLOCK))
    cos, sin = [], []
    for b in range(blocks):
        positions = torch.arange(b * ROPE_BLOCK, (b + 1) * ROPE_BLOCK, device=weight.device)[None, :]
        c, s = inner.rotary_emb(probe, positions)
        cos.append(c[0])
        sin.append(s[0])
    return torch.cat(cos).contiguous(), torch.cat(sin).contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF apply_rotary_pos_emb on [T, heads, D] with per-token cos/sin [T, D], elementwise in the dtype."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class InvariantDecoder:
    """The batch-invariant forward of one Llama-family *ForCausalLM (its modules read in place)."""

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

    def hidden(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """input_ids [T]; cos/sin [T, D] (rope_table rows of the tokens' positions) -> final normed hidden [T, d]."""
        x = self.inner.embed_tokens(input_ids)
        for i, layer in enumerate(self.inner.layers):
            x = x + self._attention(i, layer, self._norm(x, layer.input_layernorm), cos, sin, attend)
            h = self._norm(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            gated = ops.silu_mul(self._linear(h, mlp.gate_proj), self._linear(h, mlp.up_proj))
            x = x + self._linear(gated, mlp.down_proj)
        return self._norm(x, self.inner.norm)

    def _attention(self, i: int, layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend: Attend) -> torch.Tensor:
        attn = layer.self_attn
        tokens = h.shape[0]
        q = self._linear(h, attn.q_proj).view(tokens, self.num_heads, self.head_dim)
        k = self._linear(h, attn.k_proj).view(tokens, self.num_kv_heads, self.head_dim)
        v = self._linear(h, attn.v_proj).view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: RMSNorm of each head's query and key
            q, k = self._norm(q, attn.q_norm), self._norm(k, attn.k_norm)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = attend(i, q, k, v, self.windows[i])
        return self._linear(o.reshape(tokens, self.num_heads * self.head_dim), attn.o_proj)

    @staticmethod
    def _linear(x: torch.Tensor, module: Any) -> torch.Tensor:
        return ops.linear(x, module.weight, module.bias)

    @staticmethod
    def _norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
        return ops.rms_norm(x, norm.weight, norm.variance_epsilon)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM-head logits [R, V] in the model's dtype by the batch-invariant matmul (the engine's sampling rows)."""
        head = self.hf.lm_head
        return ops.kernels.linear(hidden, head.weight, head.bias, out=out)

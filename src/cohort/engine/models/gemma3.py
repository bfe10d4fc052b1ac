"""Engine forward of Gemma 3 text models (Gemma3ForCausalLM, model_type "gemma3_text", e.g. Gemma-3-270M).

What differs from the Llama family (decoder.py), each following transformers' modeling_gemma3:
- RMSNorm scales by (1 + weight), computed in float32 and cast back after the scale (Llama casts first);
- four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre-feedforward and post-feedforward (on the MLP output, before the residual add);
- q/k norms (the same (1 + weight) RMSNorm over each head) before RoPE;
- local layers ("sliding_attention") attend to the last `sliding_window` tokens with their own RoPE base
  (10k), global layers ("full_attention") to everything with theirs (1M, scaled on the larger models): one
  RoPE table per layer type, from the model's own rotary module;
- attention scale query_pre_attn_scalar ** -0.5 (the HF module's `scaling`);
- the embedding module multiplies by sqrt(hidden) itself (the engine calls it); tied LM head;
- GELU-tanh gate (the MLP's own act_fn); final logit soft-capping when the config sets it.
Attention-logit soft-capping (Gemma 2) and bidirectional attention are refused by `unsupported`. In
generation.logprob_parity=exact the forward is cohort.forward.invariant's (models/exact.py), as for the Llama family.
"""

from __future__ import annotations

import torch
from torch import nn

from cohort.engine.attention import AttentionOps, AttnContext
from cohort.engine.models.decoder import DecoderForward, HFModule, rope_types
from cohort.engine.models.layers import compile_shape_generic

_DYNAMIC_ROPE = ("dynamic", "longrope")


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma3RMSNorm: normalise in float32, scale by (1 + weight) in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gemma_residual(x: torch.Tensor, delta: torch.Tensor, post_weight: torch.Tensor, next_weight: torch.Tensor,
                   eps: float):
    """x + post_norm(delta) (the residual add in the model dtype), then the next norm of the sum."""
    x = x + gemma_rms_norm(delta, post_weight, eps)
    return x, gemma_rms_norm(x, next_weight, eps)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


class _GemmaOps:
    """The pieces above, torch.compile'd on CUDA (one kernel each), plain on the CPU."""

    def __init__(self, compile_: bool) -> None:
        # compile_shape_generic: one graph per dtype and rank (a plain torch.compile recompiled per batch size,
        # head count and norm width past dynamo's limit during graph capture)
        wrap = compile_shape_generic if compile_ else (lambda f, weights=(): f)
        self.rms_norm = wrap(gemma_rms_norm, weights=(1,))
        self.residual = wrap(gemma_residual, weights=(2, 3))
        self.gelu_tanh_mul = wrap(gelu_tanh_mul)


class Gemma3Forward(DecoderForward):
    model_types = ("gemma3_text",)

    @classmethod
    def unsupported(cls, model: HFModule) -> str | None:
        config = model.config
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
            return f"{type(model).__name__} lacks .model.layers / .lm_head; expected Gemma3ForCausalLM."
        if getattr(config, "attn_logit_softcapping", None) is not None:
            return (f"attn_logit_softcapping={config.attn_logit_softcapping}: attention-logit soft-capping is "
                    "not implemented in the engine's attention.")
        if getattr(config, "use_bidirectional_attention", False):
            return "use_bidirectional_attention=True (an encoder-style Gemma): the engine decodes causally."
        for rope_type in rope_types(config):
            if rope_type in _DYNAMIC_ROPE:
                return f"rope_type={rope_type!r} changes with sequence length; the engine precomputes RoPE tables."
        return None

    def __init__(self, model: nn.Module, attention: AttentionOps, max_len: int,
                 fuse_projections: bool | None = None) -> None:
        super().__init__(model, attention, max_len, fuse_projections)
        config = self.hf.config
        self.layer_types = list(config.layer_types)[: self.num_layers]
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.gemma = _GemmaOps(compile_=self.device.type == "cuda")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self._gelu_tanh = act in ("gelu_pytorch_tanh", "gelu_tanh")

    @torch.inference_mode()
    def _rope_tables(self, max_len: int):
        """{layer type: (cos [max_len, D], sin [max_len, D])} from the model's rotary module."""
        positions = torch.arange(max_len, device=self.device)[None, :]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = {}, {}
        for layer_type in sorted(set(self.hf.config.layer_types)):
            c, s = self.inner.rotary_emb(probe, positions, layer_type)
            cos[layer_type], sin[layer_type] = c[0].contiguous(), s[0].contiguous()
        return cos, sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [2, layers, blocks, block_size, kv_heads, D]. -> [T, hidden]."""
        if self.exact is not None:  # generation.logprob_parity=exact: the trainer's batch-invariant forward
            return self.exact.forward(input_ids, positions, ctx, kv_cache)
        g, layers = self.gemma, self.inner.layers
        x = self.inner.embed_tokens(input_ids)  # Gemma3TextScaledWordEmbedding multiplies by sqrt(hidden)
        tables = {t: (self.cos[t][positions], self.sin[t][positions]) for t in self.cos}
        first = layers[0].input_layernorm
        h = g.rms_norm(x, first.weight, first.eps)
        for i, layer in enumerate(layers):
            cos, sin = tables[self.layer_types[i]]
            delta = self._attention(i, layer, h, cos, sin, ctx, kv_cache)
            x, h = g.residual(x, delta, layer.post_attention_layernorm.weight, layer.pre_feedforward_layernorm.weight,
                              layer.post_attention_layernorm.eps)
            delta = self._mlp(i, layer, h)
            following = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.inner.norm
            x, h = g.residual(x, delta, layer.post_feedforward_layernorm.weight, following.weight,
                              layer.post_feedforward_layernorm.eps)
        return h

    def _head_norm(self, x: torch.Tensor, norm: HFModule) -> torch.Tensor:
        return self.gemma.rms_norm(x, norm.weight, norm.eps)

    def _mlp(self, i: int, layer: HFModule, h: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        if self.fused:
            gate, up = torch.nn.functional.linear(h, self.fused[i][2]).chunk(2, dim=-1)
        else:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        act = self.gemma.gelu_tanh_mul(gate, up) if self._gelu_tanh else mlp.act_fn(gate) * up
        return mlp.down_proj(act)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().logits(hidden, out)
        if self.softcap is not None:
            # as Gemma3ForCausalLM.forward: logits / cap -> tanh -> * cap, in the logits' dtype
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

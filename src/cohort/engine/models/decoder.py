"""Packed forward of Llama-family decoders (Llama / SmolLM2, Mistral, Qwen2 / Qwen2.5, Qwen3) over the HF modules.

The engine calls the policy model's own submodules (`q_proj`, `mlp`, the norms, ...) on packed tokens
[T, hidden] with its own attention over the paged KV cache, so it always computes with the trainer's current
weights (nothing to copy after an optimizer step) and a LoRA wrapper around a projection (PEFT replaces the
`nn.Linear` by a module whose forward adds the adapter) is applied without merging. The numerics follow the
HF modeling code (RMSNorm in float32, RoPE tables from the model's own rotary embedding) so greedy output
matches `generate` and the sampling logprobs match the trainer's recompute.

Other families subclass `DecoderForward` (models/gemma3.py, models/qwen3_moe.py); models/registry.py picks
the class from `config.model_type`. Sliding-window layers (Mistral, Qwen with use_sliding_window) get their
window from `layer_windows` and pass it to the attention.

On CUDA with Triton, RoPE and the K/V cache write of each layer are one kernel (triton_rope.rope_store_kv,
same numerics as `layers.rope` run eagerly); `fused_rope_kv` says which path an instance takes, and
COHORT_FUSED_ROPE_KV=0 in the environment turns it off for the models built after (A/B against the compiled
RoPE + index_copy_ path).

generation.logprob_parity=exact (a model marked by cohort.forward.invariant.parity): `exact` holds the
batch-invariant forward (models/exact.py, the trainer's decoder and kernels over the paged cache); forward, logits
and the sampled tokens' log-probabilities (`sampled_logprobs`) go through it, and no fused copies are made.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cohort.engine import triton_rope  # the module: its kernel is looked up per call (tests swap it)
from cohort.engine.attention import AttentionOps, AttnContext, store_kv
from cohort.engine.models.exact import ExactForward
from cohort.engine.models.layers import fused_ops
from cohort.forward.invariant.parity import is_exact

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_UNSUPPORTED_ROPE = ("dynamic", "longrope")
_MISSING = object()


# A Hugging Face module the engine reaches into by attribute name (layer.self_attn.q_proj, norm.weight): torch types
# every nn.Module attribute as `Tensor | Module`, so these are duck-typed; each family's `unsupported` checks the
# structure before a forward is built.
HFModule = Any


def unwrap_model(model: nn.Module) -> HFModule:
    """The *ForCausalLM inside a PEFT wrapper (its LoRA layers stay in place and run in our forward).

    An HFModule: the engine reaches its parts by name (`.model.layers[i].self_attn.q_proj`)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def rope_types(config) -> list[str]:
    """The RoPE types a config uses (one per layer type for Gemma 3's per-layer-type rope_parameters)."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return ["default"]
    if any(isinstance(v, dict) for v in rope.values()):
        return [str(v.get("rope_type", v.get("type", "default"))) for v in rope.values() if isinstance(v, dict)]
    return [str(rope.get("rope_type", rope.get("type", "default")))]


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as the HF modeling code applies it.

    Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 attention modules carry `sliding_window` (None on full-attention
    layers, and None everywhere unless the config enables it); Mistral's attention reads
    `config.sliding_window` directly, for every layer.
    """
    inner = unwrap_model(model).model
    config = unwrap_model(model).config
    windows = []
    for layer in inner.layers:
        window: Any = getattr(layer.self_attn, "sliding_window", _MISSING)
        if window is _MISSING:
            window = getattr(config, "sliding_window", None)
        windows.append(int(window) if window else None)
    return windows


def unsupported_mlp_or_rope(config) -> str | None:
    """Why the engine's decoder cannot run a language model with this config's MLP or RoPE (None: it can)."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return (f"hidden_act={act!r}: the engine expects silu (it calls the model's own MLP, but was only "
                "checked with silu).")
    for rope_type in rope_types(config):
        if rope_type in _UNSUPPORTED_ROPE:
            return f"rope_type={rope_type!r} changes with sequence length; the engine precomputes RoPE tables."
    return None


class DecoderForward:
    """Runs a *ForCausalLM of a supported family on packed tokens with paged attention."""

    model_types: tuple[str, ...] = SUPPORTED_MODEL_TYPES
    # False where a step needs host synchronisation (then the runner never captures CUDA graphs).
    graph_safe = True
    # RoPE + cache write in one Triton kernel (set per instance in __init__; subclasses that build
    # themselves without it, like the VLM decoder, keep the unfused path).
    fused_rope_kv = False
    # exact logprob parity's forward (set per instance in __init__; None: the fast path)
    exact: ExactForward | None = None

    @classmethod
    def unsupported(cls, model: HFModule) -> str | None:
        """Why this class cannot run `model` (None: it can). `model` is already unwrapped from PEFT."""
        config = model.config
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
            return f"{type(model).__name__} lacks .model.layers / .lm_head; expected a *ForCausalLM."
        return unsupported_mlp_or_rope(config)

    def __init__(self, model: nn.Module, attention: AttentionOps, max_len: int,
                 fuse_projections: bool | None = None) -> None:
        hf = unwrap_model(model)
        reason = self.unsupported(hf)
        if reason is not None:
            raise ValueError(reason)
        config = hf.config
        self.hf = hf
        self.inner = hf.model
        self.attention = attention
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = len(self.inner.layers)
        first = self.inner.layers[0].self_attn
        self.scale = float(getattr(first, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(first, "q_norm")
        self.windows = layer_windows(model)
        self.cos, self.sin = self._rope_tables(max_len)
        self.ops = fused_ops(self.device)
        self.fused_rope_kv = triton_rope.fused_rope_kv_supported(self.device, self.head_dim)
        self.fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        # exact parity: the batch-invariant forward, which reads the separate projections in place
        self.exact = ExactForward(model, max_len) if is_exact(model) else None
        if self.exact is not None:
            fuse_projections = False
        if fuse_projections is None:
            fuse_projections = self._plain_linears() and self._fused_copies_fit()
        if fuse_projections and self._plain_linears():
            self.refresh_fused()

    def _fused_copies_fit(self) -> bool:
        """Auto mode: fuse on CUDA when the copies take under a quarter of the free device memory."""
        if self.device.type != "cuda":
            return False
        layer = self.inner.layers[0]
        names = [("self_attn", n) for n in ("q_proj", "k_proj", "v_proj")] + [("mlp", "gate_proj"), ("mlp", "up_proj")]
        per_layer = sum(getattr(getattr(layer, a), n).weight.numel() for a, n in names)
        needed = per_layer * self.num_layers * self.dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        return needed < free // 4

    def _plain_linears(self) -> bool:
        """Fused copies only replace plain nn.Linear layers: a LoRA wrapper must keep running its own forward."""
        names = ("q_proj", "k_proj", "v_proj")
        return all(
            type(getattr(layer.self_attn, n)) is nn.Linear for layer in self.inner.layers for n in names
        ) and all(
            type(getattr(layer.mlp, n, None)) is nn.Linear for layer in self.inner.layers for n in ("gate_proj", "up_proj")
        )

    @torch.no_grad()
    def refresh_fused(self) -> None:
        """(Re)build the concatenated QKV and gate-up weights from the model's current parameters."""
        rebuilt = []
        for i, layer in enumerate(self.inner.layers):
            a, m = layer.self_attn, layer.mlp
            old = self.fused[i] if i < len(self.fused) else (None, None, None)
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], out=old[0]) if old[0] is not None \
                else torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            bias = None
            if a.q_proj.bias is not None:
                # out= keeps the storage: captured CUDA graphs hold these addresses.
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias], out=old[1]) if old[1] is not None \
                    else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight], out=old[2]) if old[2] is not None \
                else torch.cat([m.gate_proj.weight, m.up_proj.weight])
            rebuilt.append((qkv, bias, gate_up))
        self.fused = rebuilt

    @torch.inference_mode()
    def refresh_rope(self) -> None:
        """Recompute the RoPE tables from the rotary module's current buffers, in place (captured CUDA graphs
        hold their addresses). A served engine's model gets the trainer's frequencies with each push
        (serving/weights.model_tensors), which may differ from its own (a trainer's .to(bfloat16) rounds them)."""
        first = next(iter(self.cos.values())) if isinstance(self.cos, dict) else self.cos
        cos, sin = self._rope_tables(first.shape[0])
        if isinstance(self.cos, dict):
            for key in self.cos:
                self.cos[key].copy_(cos[key])
                self.sin[key].copy_(sin[key])
        else:
            self.cos.copy_(cos)
            self.sin.copy_(sin)
        if self.exact is not None:
            self.exact.refresh_rope()

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.inner.embed_tokens.weight.device

    @torch.inference_mode()
    def _rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The model's own rotary module handles every static RoPE variant (default, llama3, linear, yarn).
        positions = torch.arange(max_len, device=self.device)[None, :]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.inner.rotary_emb(probe, positions)
        return cos[0].contiguous(), sin[0].contiguous()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [2, layers, blocks, block_size, kv_heads, D]. -> [T, hidden]."""
        if self.exact is not None:
            return self.exact.forward(input_ids, positions, ctx, kv_cache)
        ops, layers = self.ops, self.inner.layers
        x = self.inner.embed_tokens(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        norm = layers[0].input_layernorm
        h = ops.rms_norm(x, norm.weight, norm.variance_epsilon)
        for i, layer in enumerate(layers):
            delta = self._attention(i, layer, h, cos, sin, ctx, kv_cache)
            norm = layer.post_attention_layernorm
            x, h = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
            delta = self._mlp(i, layer, h)
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.inner.norm
            x, h = ops.add_rms_norm(x, delta, norm.weight, norm.variance_epsilon)
        return h

    def _qkv(self, i: int, attn: HFModule, h: torch.Tensor):
        if self.fused:
            weight, bias, _ = self.fused[i]
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return F.linear(h, weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

    def _attention(self, i: int, layer: HFModule, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   ctx: AttnContext, kv_cache: torch.Tensor) -> torch.Tensor:
        attn = layer.self_attn
        tokens = h.shape[0]
        q, k, v = self._qkv(i, attn, h)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self._head_norm(q, attn.q_norm), self._head_norm(k, attn.k_norm)
        if self.fused_rope_kv:
            # One kernel: q and k rotated in place (views of the QKV output), k and v written to the cache.
            q, k = triton_rope.rope_store_kv(q, k, v, cos, sin, kv_cache[0, i], kv_cache[1, i], ctx.slot_mapping)
        else:
            q, k = self.ops.rope(q, k, cos, sin)
            # Not fused into the compiled RoPE: inductor functionalises an index_copy_ into a view of the cache
            # as a copy of the whole cache (measured: 700 tok/s instead of ~100k on the 0.5B benchmark).
            store_kv(kv_cache[0, i], kv_cache[1, i], k, v, ctx.slot_mapping)
        window = self.windows[i]
        if ctx.is_prefill:
            o = self.attention.prefill(q, k, v, ctx, self.scale, kv_cache[0, i], kv_cache[1, i], window=window)
        else:
            o = self.attention.decode(q, kv_cache[0, i], kv_cache[1, i], ctx, self.scale, window=window)
        return attn.o_proj(o.reshape(tokens, self.num_heads * self.head_dim))

    def _head_norm(self, x: torch.Tensor, norm: HFModule) -> torch.Tensor:
        """Qwen3's per-head q/k RMSNorm (Llama-style: weight times the normalised input)."""
        return self.ops.rms_norm(x, norm.weight, norm.variance_epsilon)

    def _mlp(self, i: int, layer: HFModule, h: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        if self.fused:
            gate, up = F.linear(h, self.fused[i][2]).chunk(2, dim=-1)
        elif hasattr(mlp, "gate_proj"):
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        else:
            return mlp(h)
        return mlp.down_proj(self.ops.silu_mul(gate, up))

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """LM-head logits; `out` (a [rows, vocab] buffer) lets every captured graph share one logits buffer."""
        if self.exact is not None:
            return self.exact.logits(hidden, out)
        head = self.hf.lm_head
        if out is None:
            return head(hidden)
        if type(head) is torch.nn.Linear and head.bias is None:
            return torch.matmul(hidden, head.weight.t(), out=out)
        return out.copy_(head(hidden))  # adapters or other heads: a transient inside the graph's pool

    def sampled_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
                         inv_temp: torch.Tensor) -> torch.Tensor:
        """The log-probabilities to report for `tokens` drawn from `logits`: the sampler's, or in exact parity the
        trainer's kernel's (graph-safe; inv_temp is the rows' float32 1/T)."""
        if self.exact is None:
            return logprobs
        return self.exact.logprobs(logits, tokens, inv_temp)

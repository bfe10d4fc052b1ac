"""The paged engine's forward for vision-language models whose language model is a Llama / Qwen2 decoder:
Qwen2-VL and Qwen2.5-VL (multimodal RoPE) and Idefics3 / SmolVLM (plain RoPE).

It is `DecoderForward` run on the VLM's language model (`model.model.language_model` / `.text_model`; the
LM head stays on the outer model), plus what a prompt with images needs at prefill (`prefill_inputs`, called
by the model runner for every prefill step):

- the embeddings of the prefilled tokens with the image features scattered into the prompt's image-token
  positions; the vision tower runs once per prefill unit, i.e. once per group of G completions, whose prompt
  KV blocks the scheduler then shares (a group split for space, or a preempted sequence recomputed, runs it
  again);
- Qwen2-VL's (temporal, height, width) positions from the model's own `get_rope_index`, turned into cos/sin
  rows by the model's own rotary module; every later token is text, whose three position components are
  equal, so decode reads the 1D table at `token index + rope_delta` (the runner adds `Sequence.rope_delta`,
  set here: max prompt position + 1 - prompt length, as transformers' `rope_deltas`).

A sequence without images (`Sequence.inputs is None`) goes through exactly the text path.
"""

from __future__ import annotations

import torch
from torch import nn

from cohort.engine.attention import AttentionOps, AttnContext
from cohort.engine.models.decoder import DecoderForward, HFModule, unsupported_mlp_or_rope, unwrap_model
from cohort.engine.models.layers import fused_ops
from cohort.vision.forward import embed_with_images, mrope_positions
from cohort.vision.model import uses_mrope

_LANGUAGE = ("language_model", "text_model")


def _language_model(model: HFModule) -> HFModule | None:
    inner = getattr(model, "model", None)
    return next((getattr(inner, n) for n in _LANGUAGE if getattr(inner, n, None) is not None), None)


class VisionDecoderForward(DecoderForward):
    model_types = ("qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm")

    @classmethod
    def unsupported(cls, model: HFModule) -> str | None:
        body = _language_model(model)
        if body is None or not hasattr(getattr(model, "model", None), "get_image_features"):
            return f"{type(model).__name__}: expected .model.get_image_features and .model.language_model/.text_model"
        if not hasattr(body, "layers") or not hasattr(model, "lm_head"):
            return f"{type(body).__name__} lacks .layers (or the model lacks .lm_head)"
        config = body.config
        if getattr(config, "model_type", "") not in ("llama", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text",
                                                      "mistral", "qwen3"):
            return f"language model type {config.model_type!r} is not a Llama/Qwen decoder the engine runs"
        return unsupported_mlp_or_rope(config)

    def __init__(self, model: nn.Module, attention: AttentionOps, max_len: int,
                 fuse_projections: bool | None = None) -> None:
        # DecoderForward.__init__ on the language model: `self.hf` keeps the whole VLM (its LM head, its
        # vision tower), `self.inner` the decoder body
        hf = unwrap_model(model)
        reason = self.unsupported(hf)
        if reason is not None:
            raise ValueError(reason)
        body = _language_model(hf)
        assert body is not None  # unsupported() found it
        config = body.config
        self.hf, self.inner, self.attention = hf, body, attention
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = len(body.layers)
        first = body.layers[0].self_attn
        self.scale = float(getattr(first, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(first, "q_norm")
        self.windows = [int(w) if (w := getattr(layer.self_attn, "sliding_window", None)) else None
                        for layer in body.layers]
        self.mrope = uses_mrope(model)
        self.cos, self.sin = self._rope_tables(max_len)
        self.ops = fused_ops(self.device)
        self.fused = []
        if fuse_projections is None:
            fuse_projections = self._plain_linears() and self._fused_copies_fit()
        if fuse_projections and self._plain_linears():
            self.refresh_fused()

    @torch.inference_mode()
    def _rope_tables(self, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The 1D (text) table; a multimodal rotary module gets its three position rows, all equal.

        Qwen2-VL's rotary module takes [3, batch, positions] ids: transformers 5.17 indexes them as 3D
        (`position_ids[:, :, None, :]`), later versions also expand a 2D [batch, positions]. The 3D form works
        with both and gives the text positions (t = h = w = index).
        """
        if not self.mrope:
            return super()._rope_tables(max_len)
        positions = torch.arange(max_len, device=self.device)[None, None, :].expand(3, 1, max_len)
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.inner.rotary_emb(probe, positions)
        return cos[0].contiguous(), sin[0].contiguous()

    def prefill_inputs(self, units, input_ids: torch.Tensor, positions: torch.Tensor) -> dict | None:
        """Embeddings and cos/sin rows of a prefill step whose leaders carry images (None: none do)."""
        if not any(getattr(u.leader, "inputs", None) is not None for u in units):
            return None
        embeds, cos, sin, start = [], [], [], 0
        for unit in units:
            seq = unit.leader
            n = len(seq) - seq.num_cached
            ids = input_ids[start:start + n]
            prompt = seq.inputs
            if prompt is None:
                embeds.append(self.inner.embed_tokens(ids))
                pos = positions[start:start + n]
                cos.append(self.cos[pos])
                sin.append(self.sin[pos])
            else:
                if seq.num_cached:
                    raise ValueError("continuing a conversation with images is not supported by the engine")
                in_prompt = torch.arange(n, device=ids.device) < seq.num_prompt_tokens
                embeds.append(embed_with_images(self.hf, ids, [prompt], [0], in_prompt)[0])
                if self.mrope:
                    pos3 = mrope_positions(self.hf, ids, prompt)  # [3, n]
                    c, s = self.inner.rotary_emb(embeds[-1][:1], pos3[:, None, :])
                    cos.append(c[0])
                    sin.append(s[0])
                    delta = int(pos3[:, :seq.num_prompt_tokens].max()) + 1 - seq.num_prompt_tokens
                    for member in unit.seqs:
                        member.rope_delta = delta
                else:
                    pos = positions[start:start + n]
                    cos.append(self.cos[pos])
                    sin.append(self.sin[pos])
            start += n
        return {"inputs_embeds": torch.cat(embeds), "cos": torch.cat(cos).to(self.dtype),
                "sin": torch.cat(sin).to(self.dtype)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                kv_cache: torch.Tensor, inputs_embeds: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None) -> torch.Tensor:
        ops, layers = self.ops, self.inner.layers
        x = self.inner.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if cos is None or sin is None:
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

"""Engine forward of Qwen3-MoE (model_type "qwen3_moe"): Qwen3 attention, routed experts in the MLP.

The attention, norms and RoPE are Qwen3's (decoder.py). A sparse layer (every `decoder_sparse_step`-th layer
not in `mlp_only_layers`; the others keep a dense MLP) routes each token as Qwen3MoeTopKRouter does:
softmax over the experts in float32, top-k, renormalised to sum 1 when `norm_topk_prob`, cast to the model
dtype. The experts' weights are transformers' stacked tensors `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I]. The token-expert pairs are sorted by expert, so each expert's tokens are one contiguous slice:

- grouped (CUDA, bf16/fp16, torch with `grouped_mm`): two grouped matmuls over all experts at once, with
  offsets computed on the device, so a decode step needs no host synchronisation and runs inside CUDA graphs;
- per-expert loop (elsewhere): one matmul pair per expert that received tokens, like the HF eager path
  (its token counts are read on the host, so the runner captures no graphs: `graph_safe` is False).

Either way the weighted expert outputs are summed into each token's row in expert order, as HF does.

Router replay (engine/routing.py): while `route_out` is a [tokens, sparse layers, k] buffer, every sparse layer
writes the experts it chose into its column (inside a CUDA graph too: the buffer is a static one); None, the
default, writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cohort.engine.attention import AttentionOps
from cohort.engine.models.decoder import DecoderForward, HFModule
from cohort.forward.router_replay import is_sparse_block, route_dtype


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


def route(h: torch.Tensor, router_weight: torch.Tensor, top_k: int, normalize: bool):
    """(weights [T, k] in h's dtype, expert ids [T, k]) as Qwen3MoeTopKRouter computes them."""
    probs = F.linear(h, router_weight).softmax(dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def moe_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, act, grouped: bool) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(h[t]) for every token t. h [T, H] -> [T, H].

    gate_up [E, 2I, H], down [E, H, I]: expert e computes down[e] @ (act(g) * u), (g, u) = gate_up[e] @ x.
    """
    num_experts = gate_up.shape[0]
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # pairs grouped by expert, tokens ascending inside
    token = order // top_k
    pair_weight = weights.reshape(-1)[order]
    x = h[token]
    out = torch.zeros_like(h)
    if grouped:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=h.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        mm = _grouped_mm_fn()
        gate, up = mm(x, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        y = mm(act(gate) * up, down.transpose(1, 2), offs=offsets)
        out.index_add_(0, token, (y * pair_weight[:, None]).to(out.dtype))
        return out
    per_expert: list[int] = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for e, n in enumerate(per_expert):
        if n == 0:
            continue
        rows = slice(start, start + n)
        start += n
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[e])
        out.index_add_(0, token[rows], (y * pair_weight[rows, None]).to(out.dtype))
    return out


class Qwen3MoeForward(DecoderForward):
    model_types = ("qwen3_moe",)

    @classmethod
    def unsupported(cls, model: HFModule) -> str | None:
        reason = super().unsupported(model)
        if reason is not None:
            return reason
        for i, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            if is_sparse_block(mlp) and not (hasattr(mlp.experts, "gate_up_proj") and hasattr(mlp.experts, "down_proj")):
                return (f"layer {i}: experts without stacked gate_up_proj / down_proj tensors (an older "
                        "transformers layout); upgrade transformers to 5.x.")
            if getattr(getattr(mlp, "shared_expert", None), "gate_proj", None) is not None:
                return f"layer {i}: shared experts (Qwen2-MoE style) are not implemented in the engine."
        return None

    def __init__(self, model: nn.Module, attention: AttentionOps, max_len: int,
                 fuse_projections: bool | None = None) -> None:
        super().__init__(model, attention, max_len, fuse_projections)
        config = self.hf.config
        self.grouped = (self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
                        and _grouped_mm_fn() is not None)
        self.graph_safe = self.grouped
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", True))
        # router replay: each sparse layer's column in a record, the record's shape and type, its target buffer
        self.sparse_column: dict[int, int] = {}
        for i, layer in enumerate(self.inner.layers):
            if is_sparse_block(layer.mlp):
                self.sparse_column[i] = len(self.sparse_column)
        self.routing_shape = (len(self.sparse_column), self.top_k) if self.sparse_column else None
        self.route_dtype = route_dtype(config.num_experts)
        self.route_out: torch.Tensor | None = None

    def _plain_linears(self) -> bool:
        # Fused gate-up copies would need every layer's MLP to be dense; attention projections alone are
        # not worth a second code path here (correctness first).
        return False

    def _mlp(self, i: int, layer: HFModule, h: torch.Tensor) -> torch.Tensor:
        mlp = layer.mlp
        if not is_sparse_block(mlp):
            return super()._mlp(i, layer, h)
        router = mlp.gate
        top_k = getattr(router, "top_k", self.top_k)
        normalize = bool(getattr(router, "norm_topk_prob", self.norm_topk_prob))
        weights, experts = route(h, router.weight, top_k, normalize)
        if self.route_out is not None:
            self.route_out[:, self.sparse_column[i]] = experts
        ex = mlp.experts
        return moe_experts(h, weights, experts, ex.gate_up_proj, ex.down_proj, ex.act_fn, self.grouped)

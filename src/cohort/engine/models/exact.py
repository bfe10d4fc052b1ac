"""The engine's forward in generation.logprob_parity=exact: the trainer's batch-invariant decoder over the paged cache.

`ExactForward` runs cohort.forward.invariant.decoder.InvariantDecoder, the same code the training forward runs,
with an attention callback that stores the step's K/V in the layer's cache and attends through the block tables
(cohort.forward.invariant.attention): a fresh prompt's tokens attend over the step's own packed K/V exactly as a
training row's do (`attend_packed`, segments from cu_seqlens), a continued turn's new tokens are then redone over
their cached prefix through their block tables (`attend_paged`, from the step's PrefixBatch), and a decode query
reads its row's table. One kernel for all three, so a token's hidden state, logits and log-probability are the
trainer's bit for bit whatever the step's batch. Graph-safe (decode and prefill graphs): the segments come from
cu_seqlens on the device, the decode launch covers the table width, nothing is read on the host.
"""

from __future__ import annotations

import torch

from cohort.engine.attention import AttnContext, store_kv
from cohort.forward.invariant.attention import attend_packed, attend_paged
from cohort.forward.invariant.decoder import InvariantDecoder, rope_table
from cohort.forward.invariant.parity import engine_logprobs


class ExactForward:
    """The batch-invariant forward of a Llama-family or Gemma 3 model on the engine's packed tokens and paged KV cache."""

    def __init__(self, model: torch.nn.Module, max_len: int) -> None:
        self.decoder = InvariantDecoder(model)
        self.model = model
        self.cos, self.sin = rope_table(model, max_len)

    def refresh_rope(self) -> None:
        """Recompute the RoPE table in place from the rotary module's current buffers (graphs hold its address)."""
        cos, sin = rope_table(self.model, self.cos.shape[0])
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden [T, d]; K/V of the new tokens are written to the cache."""
        scale = self.decoder.scale
        if ctx.is_prefill:
            attend = self._prefill_attention(input_ids.shape[0], ctx, kv_cache)
        else:
            tables, lens = ctx.block_tables, ctx.ctx_lens
            assert tables is not None and lens is not None  # set on every decode context
            rows = torch.arange(input_ids.shape[0], device=input_ids.device)
            keys = lens.long() - 1  # the new token is the last of its context

            def attend(i, q, k, v, window):
                store_kv(kv_cache[0, i], kv_cache[1, i], k, v, ctx.slot_mapping)
                return attend_paged(q, kv_cache[0, i], kv_cache[1, i], tables, rows, keys, scale, window)

        return self.decoder.hidden(input_ids, self.cos[:, positions], self.sin[:, positions], attend)

    def _prefill_attention(self, tokens: int, ctx: AttnContext, kv_cache: torch.Tensor):
        """The prefill's attention callback: packed segments, then the continued turns over their prefix."""
        cu = ctx.cu_seqlens
        assert cu is not None  # set on every prefill context
        index = torch.arange(tokens, device=cu.device)
        starts = cu.long()[torch.searchsorted(cu.long(), index, right=True) - 1]
        local = index - starts  # a token's place in its segment of the step
        turns = ctx.prefix_batch
        if turns is not None:
            width = turns.rows.shape[1]
            src, dest = turns.chunk_indices(0, turns.rows.shape[0])
            turn_rows, turn_keys = src // width, turns.positions.flatten()[src]
        scale = self.decoder.scale

        def attend(i, q, k, v, window):
            store_kv(kv_cache[0, i], kv_cache[1, i], k, v, ctx.slot_mapping)
            out = attend_packed(q, k, v, starts, local, scale, max(ctx.max_seqlen, 1), window)
            if turns is not None:  # their new tokens see the cached prefix: redone through their tables
                out[dest] = attend_paged(q[dest], kv_cache[0, i], kv_cache[1, i], turns.tables, turn_rows, turn_keys,
                                         scale, window)
            return out

        return attend

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder.logits(hidden, out)

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
        """The sampled tokens' log-probabilities by the trainer's kernel (the sampler's own slice the vocabulary
        by the batch's row count)."""
        return engine_logprobs(logits, tokens, inv_temp)

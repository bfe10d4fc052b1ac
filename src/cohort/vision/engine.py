"""VisionGroupEngine: rollouts for vision-language models, one vision pass and one prefill per group.

cohort's paged engine implements the text decoders itself (Llama, Qwen2, Qwen3) and has no vision tower or
multimodal RoPE yet. Plain `generate` with `num_return_sequences=G` would expand the prompt G times before
the prefill, so the vision tower and the prefill would run G times per prompt. This engine drives the
model's own modules instead (a `RolloutEngine`, like `HFGenerateEngine`):

1. the vision tower runs once per prompt (`get_image_features`), its features are scattered into the prompt's
   embeddings at the image-token positions;
2. one prefill of the prompt (the language model with a `DynamicCache`, Qwen2-VL's multimodal positions from
   `get_rope_index`) gives the first-token logits and the prompt's KV;
3. the cache rows are repeated G times: the G completions share the prompt's KV values (copied, not paged)
   and decode together as one batch; finished rows leave the batch.

Sampling is cohort's engine sampler (`cohort.engine.sampler.Sampler`, Gumbel-max over (seed, position)
noise), so a completion's tokens depend on its seed alone, and stop handling is the engine's `Sequence`:
EOS / stop ids / stop strings, `max_tokens`, logprobs of the raw logits at the sampling temperature.
Seeds: completion j of prompt i uses `seed + i * n + j`, as in the paged engine.

All prompts of a call are prefilled in one batched forward (left-padded, with an attention mask), each prompt
once; the prefill's rows are then gathered into G rows per prompt and every completion decodes in one batch,
finished ones leaving it. `stats` counts vision passes, prefills and decode steps (tests check one prefill
per group).
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from transformers import DynamicCache

from cohort.engine.sampler import Sampler
from cohort.engine.sequence import Sequence
from cohort.types import Completion, SamplingParams
from cohort.vision.forward import embed_with_images, mrope_positions, per_layer_inputs
from cohort.vision.model import language_model, unwrap, uses_mrope

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass
class VisionEngineStats:
    vision_passes: int = 0  # prompts whose images went through the vision tower
    prefills: int = 0  # prompt prefills (one per group)
    prefill_tokens: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0


class VisionGroupEngine:
    """RolloutEngine for transformers VLMs (Qwen2-VL, Qwen2.5-VL, Idefics3/SmolVLM, ...); see the module."""

    def __init__(self, model, tokenizer, *, eos_token_ids: Seq[int] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(i) for i in (eos_token_ids or ()))
        base = unwrap(model)
        self.device = base.get_input_embeddings().weight.device
        self.sampler = Sampler(self.device)  # the fused Triton sampler on CUDA, torch elsewhere
        self.stats = VisionEngineStats()
        self._rng = random.Random()
        self._ids = itertools.count()
        params = inspect.signature(language_model(model).forward).parameters
        # transformers >= 5.2x names the cache argument `cache` (past_key_values is deprecated)
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def sync_weights(self) -> None:
        """Nothing to do: the engine reads the policy's parameters in place."""

    def engine_name(self) -> str:
        return "vision group engine (HF modules: one vision pass + one prefill per group, shared KV copied G times)"

    @torch.no_grad()
    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[list[Completion]]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; pass one or one each.")
        for i, (prompt, p) in enumerate(zip(prompts, per_prompt)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; generation needs at least one prompt token")
            if p.n < 1 or p.max_tokens < 1:
                raise ValueError(f"SamplingParams n={p.n}, max_tokens={p.max_tokens} must both be >= 1.")
        if not prompts:
            return []
        was_training = self.model.training
        self.model.eval()
        try:
            return self._generate(list(prompts), per_prompt)
        finally:
            self.model.train(was_training)

    # -----------------------------------------------------------------------------------------------------
    def _prefill(self, prompts: list) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, list[int]]:
        """One batched forward over every prompt, left-padded to the longest: (cache, last-token logits [P, V],
        attention mask [P, width], each prompt's next text position)."""
        base = unwrap(self.model)
        body = language_model(base)
        mrope = uses_mrope(base)
        width = max(len(p) for p in prompts)
        dim = base.get_input_embeddings().weight.shape[1]
        dtype = base.get_input_embeddings().weight.dtype
        embeds = torch.zeros(len(prompts), width, dim, dtype=dtype, device=self.device)
        row_ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        positions = torch.zeros(3 if mrope else 1, len(prompts), width, dtype=torch.long, device=self.device)
        next_positions = []
        for i, prompt in enumerate(prompts):
            ids = torch.tensor(list(prompt), dtype=torch.long, device=self.device)
            pad = width - len(prompt)
            embeds[i, pad:] = embed_with_images(base, ids, [prompt], [0])[0]
            row_ids[i, pad:] = ids
            if getattr(prompt, "num_images", 0):
                self.stats.vision_passes += 1
            mask[i, pad:] = 1
            pos = mrope_positions(base, ids, prompt) if mrope else torch.arange(len(prompt), device=self.device)[None]
            positions[:, i, pad:] = pos
            next_positions.append(int(pos.max()) + 1)
        cache = DynamicCache(config=body.config)
        out = body(inputs_embeds=embeds, attention_mask=mask, position_ids=positions if mrope else positions[0],
                   use_cache=True, **per_layer_inputs(base, row_ids), **{self._cache_arg: cache})
        self.stats.prefills += len(prompts)
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        return cache, base.get_output_embeddings()(out.last_hidden_state[:, -1]), mask, next_positions

    def _generate(self, prompts: list, per_prompt: list[SamplingParams]) -> list[list[Completion]]:
        base = unwrap(self.model)
        body = language_model(base)
        mrope = uses_mrope(base)
        cache, first_logits, prompt_mask, next_positions = self._prefill(prompts)
        groups: list[list[Sequence]] = []
        owner: list[int] = []  # prompt index of every row
        for i, (prompt, params) in enumerate(zip(prompts, per_prompt)):
            base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
            stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
            groups.append([Sequence(seq_id=next(self._ids), token_ids=list(prompt), num_prompt_tokens=len(prompt),
                                    params=params, seed=base_seed + i * params.n + j, request_index=(i, j),
                                    stop_ids=stop_ids) for j in range(params.n)])
            owner += [i] * params.n
        seqs = [s for group in groups for s in group]
        rows = torch.tensor(owner, device=self.device)
        # every completion starts from its prompt's KV: rows of the prefill, gathered (repeated) n times each.
        # reorder_cache (an index_select per layer) exists on every transformers cache layer, the recurrent
        # states of linear-attention layers (Qwen3.5) included; batch_select_indices does not.
        cache.reorder_cache(cast(torch.LongTensor, rows))
        logits, mask = first_logits[rows], prompt_mask[rows]
        start = torch.tensor([next_positions[i] for i in owner], device=self.device)
        live = list(range(len(seqs)))
        step = 0
        while True:
            tokens, logprobs = self.sampler(logits, [seqs[r] for r in live])
            still = [k for k, r in enumerate(live) if not seqs[r].append(tokens[k], logprobs[k], self.tokenizer)]
            if not still:
                break
            if len(still) < len(live):  # finished rows leave the batch and the cache
                keep = torch.tensor(still, device=self.device)
                cache.reorder_cache(cast(torch.LongTensor, keep))
                mask, start = mask[keep], start[keep]
                tokens = [tokens[k] for k in still]
                live = [live[k] for k in still]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            pos = (start + step)[:, None]
            if mrope:
                pos = pos[None].expand(3, -1, -1)
            step_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
            out = body(inputs_embeds=base.get_input_embeddings()(step_ids), attention_mask=mask, position_ids=pos,
                       use_cache=True, **per_layer_inputs(base, step_ids), **{self._cache_arg: cache})
            logits = base.get_output_embeddings()(out.last_hidden_state[:, -1])
            step += 1
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(live)
        return [[Completion(s.completion_ids, s.logprobs, s.finish_reason or "length") for s in group]
                for group in groups]

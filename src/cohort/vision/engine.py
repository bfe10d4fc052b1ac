"""VisionGroupEngine: rollouts for vision-language models, one vision pass and one prefill per group.

cohort's paged engine implements the text decoders itself (Llama, Qwen2, Qwen3) and has no vision tower or
multimodal RoPE yet. Plain `generate` with `num_return_sequences=G` would expand the prompt G times before
the prefill, so the vision tower and the prefill would run G times per prompt. This engine drives the
model's own modules instead (a `RolloutEngine`, like `HFGenerateEngine`):

1. the vision tower runs once per prompt (`get_image_features`), its features are scattered into the prompt's
   embeddings at the image-token positions;
2. one prefill of the prompt (the language model with a `DynamicCache`, Qwen2-VL's multimodal positions from
   `get_rope_index`) gives the first-token logits and the prompt's KV;
3. the cache is repeated G times (`batch_repeat_interleave`): the G completions share the prompt's KV values
   (copied, not paged) and decode together as one batch; finished rows leave the batch.

Sampling is cohort's engine sampler (`cohort.engine.sampler.Sampler`, Gumbel-max over (seed, position)
noise), so a completion's tokens depend on its seed alone, and stop handling is the engine's `Sequence`:
EOS / stop ids / stop strings, `max_tokens`, logprobs of the raw logits at the sampling temperature.
Seeds: completion j of prompt i uses `seed + i * n + j`, as in the paged engine.

Decoding runs one group at a time (its rows share one prompt length, so no padding or masks are needed);
that keeps the code small and exact, at the cost of batching across prompts. `stats` counts vision passes,
prefills and decode steps (tests check one prefill per group).
"""

from __future__ import annotations

import inspect
import itertools
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from cohort.engine.sampler import Sampler
from cohort.engine.sequence import Sequence
from cohort.types import Completion, SamplingParams
from cohort.vision.forward import embed_with_images, mrope_positions
from cohort.vision.model import language_model, unwrap, uses_mrope


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
        self.sampler = Sampler(self.device, use_triton=False)
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
        was_training = self.model.training
        self.model.eval()
        try:
            return [self._group(i, prompt, p) for i, (prompt, p) in enumerate(zip(prompts, per_prompt))]
        finally:
            self.model.train(was_training)

    # -----------------------------------------------------------------------------------------------------
    def _group(self, index: int, prompt, params: SamplingParams) -> list[Completion]:
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty; generation needs at least one prompt token")
        if params.n < 1 or params.max_tokens < 1:
            raise ValueError(f"SamplingParams n={params.n}, max_tokens={params.max_tokens} must both be >= 1.")
        from transformers import DynamicCache

        base = unwrap(self.model)
        body = language_model(base)
        head = base.get_output_embeddings()
        ids = torch.tensor(list(prompt), dtype=torch.long, device=self.device)
        embeds = embed_with_images(base, ids, [prompt], [0])
        if getattr(prompt, "num_images", 0):
            self.stats.vision_passes += 1
        mrope = uses_mrope(base)
        if mrope:
            positions = mrope_positions(base, ids, prompt)[:, None, :]  # [3, 1, P]
            next_position = int(positions.max()) + 1
        else:
            positions = torch.arange(len(prompt), device=self.device)[None]
            next_position = len(prompt)
        cache = DynamicCache(config=body.config)
        out = body(inputs_embeds=embeds, position_ids=positions, use_cache=True, **{self._cache_arg: cache})
        self.stats.prefills += 1
        self.stats.prefill_tokens += len(prompt)
        logits = head(out.last_hidden_state[:, -1])  # [1, V]
        n = params.n
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        seqs = [Sequence(seq_id=next(self._ids), token_ids=list(prompt), num_prompt_tokens=len(prompt), params=params,
                         seed=base_seed + index * n + j, request_index=(index, j), stop_ids=stop_ids)
                for j in range(n)]
        if n > 1:
            cache.batch_repeat_interleave(n)  # the G completions start from the same prompt KV
            logits = logits.expand(n, -1)
        live = list(range(n))  # rows of the cache / logits, in seqs order
        step = 0
        while True:
            tokens, logprobs = self.sampler(logits, [seqs[j] for j in live])
            still = []
            for row, j in enumerate(live):
                if not seqs[j].append(tokens[row], logprobs[row], self.tokenizer):
                    still.append(row)
            if not still:
                break
            if len(still) < len(live):  # drop finished rows from the batch and the cache
                keep = torch.tensor(still, device=self.device)
                cache.batch_select_indices(keep)
                tokens = [tokens[r] for r in still]
                live = [live[r] for r in still]
            step_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
            pos = torch.full((len(live), 1), next_position + step, dtype=torch.long, device=self.device)
            if mrope:
                pos = pos[None].expand(3, -1, -1)
            out = body(inputs_embeds=base.get_input_embeddings()(step_ids), position_ids=pos, use_cache=True,
                       **{self._cache_arg: cache})
            logits = head(out.last_hidden_state[:, -1])
            step += 1
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(live)
        return [Completion(s.completion_ids, s.logprobs, s.finish_reason or "length") for s in seqs]

"""Reference rollout engine on Hugging Face `model.generate` (CPU or GPU).

It implements `cohort.types.RolloutEngine` with no engine of its own: every prompt is repeated `n` times,
the rows are left-padded and generated in batches of `batch_size` rows. It is the fallback for models
cohort's paged engine does not support and the ground truth the fast engine is tested against.

Semantics (see `cohort.types.SamplingParams`):
- temperature 0 is greedy; top_k 0 / top_p 1 / min_p 0 / repetition_penalty 1 are off. Every knob is set
  explicitly, because `generate` would otherwise fill unset ones from the model's generation_config
  (SmolLM2's hub config, for one, sets a temperature and top_p of its own).
- Each completion is cut after its first EOS / stop token id (kept) or at the end of the first stop string
  (finish_reason "stop"), else it ends at max_tokens ("length"). ignore_eos turns EOS off (stop ids stay).
- The logprob of each token is `log_softmax(raw_logits / T)[token]` on the model's raw logits
  (`output_logits=True`), before any processor, with T = params.logprob_temperature.
- Seeds: row r = i * n + j (completion j of prompt i). A batch of rows starting at row s is sampled under
  `torch.manual_seed(seed + s)` inside `torch.random.fork_rng`, so the trainer's RNG stream is untouched.
  With batch_size=1 completion r uses exactly seed + r, as the protocol states; with larger batches the
  results are deterministic for a given batch_size but depend on it (generate draws one batch at a time).

Multi-turn: `generate_turns` has CohortEngine's contract and is its reference: after each round of tool
results it calls `generate` again on the whole conversations that continue (prompt, completion so far, appended
context), in one batch as TRL does (one row at a time with batch_size=1); it re-prefills everything every turn,
which is what the paged engine avoids.

More GenerationConfig options (generation.hf_generate_kwargs: beam sampling, length_penalty, ...) pass through
as given; with num_beams > 1 the logprobs come from one forward over the returned rows (generate keeps logits
per beam and step, not per returned sequence).

Memory: `output_logits` keeps [rows, steps, vocab] logits until the batch ends; bound it with batch_size.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from cohort.engine.turns_by_regeneration import generate_turns_by_regeneration
from cohort.forward.plugins import has_extra_inputs
from cohort.types import Completion, SamplingParams, TurnCallback


class HFGenerateEngine:
    """RolloutEngine backed by `model.generate`; reads the policy's weights in place (no sync needed)."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        eos_token_ids: Sequence[int] | None = None,
        batch_size: int | None = None,
        cache_implementation: str | None = None,
        compile: bool = False,
        generate_kwargs: dict | None = None,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1 (rows per generate call) or None (all)")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.cache_implementation = cache_implementation
        self.compile = compile
        # more GenerationConfig options (generation.hf_generate_kwargs, checked by cohort.config.hf_generate)
        self.generate_kwargs = dict(generate_kwargs or {})
        self.num_beams = int(self.generate_kwargs.get("num_beams", 1))
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _default_eos(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer has neither pad_token_id nor eos_token_id; set tokenizer.pad_token")
        self.pad_token_id = int(pad)

    def sync_weights(self) -> None:
        """Nothing to do: generate reads the policy's parameters directly."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if params.n < 1 or params.max_tokens < 1:
            raise ValueError(f"SamplingParams n={params.n} and max_tokens={params.max_tokens} must be >= 1")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
        rows = [p for p in prompts for _ in range(params.n)]  # (prompts with images keep them: _image_inputs)
        step = self.batch_size or max(len(rows), 1)
        flat: list[Completion] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(rows), step):
                flat += self._generate_rows(rows[start : start + step], params, start)
        finally:
            self.model.train(was_training)
        return [flat[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def generate_turns(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       on_turn_end: TurnCallback) -> list[list[Completion]]:
        """CohortEngine.generate_turns' contract (see there), by re-running `generate` on the conversations
        (cohort.engine.turns_by_regeneration). The conversations that continue after a round of tool results go
        into one `generate` call (in rows of batch_size), as TRL regenerates them; batch_size=1 runs one call
        per conversation. Seeds: the first turn samples as `generate` does; with batch_size=1 later turns of row r
        use seed + r + 7919 * turn, in a batch the seed of its first row."""
        return generate_turns_by_regeneration(self._generate_round, prompts, params, on_turn_end,
                                              batched=self.batch_size != 1)

    def _generate_round(self, prompts: Sequence[Sequence[int]],
                        params: SamplingParams | Sequence[SamplingParams]) -> list[list[Completion]]:
        """`generate`, or one round of continuations (one SamplingParams per prompt, n=1, each its own room and
        seed): they share one generate call per batch_size rows, up to the longest room, and each completion is
        then cut to its own room ("length" when cut)."""
        if isinstance(params, SamplingParams):
            return self.generate(prompts, params)
        per = list(params)
        # turns_by_regeneration shifts row i's seed down by i (cohort's engine adds it back): undo that here
        seeds = [None if p.seed is None else p.seed + i for i, p in enumerate(per)]
        step = self.batch_size or max(len(per), 1)
        out: list[list[Completion]] = []
        for start in range(0, len(per), step):
            chunk = range(start, min(start + step, len(per)))
            shared = dataclasses.replace(per[start], n=1, max_tokens=max(per[i].max_tokens for i in chunk),
                                         seed=seeds[start])
            groups = self.generate([prompts[i] for i in chunk], shared)
            out += [[_cut(group[0], per[i].max_tokens)] for i, group in zip(chunk, groups, strict=True)]
        return out

    # -----------------------------------------------------------------------------------------------------

    def _generation_config(self, params: SamplingParams):
        eos = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        sampling = {}
        if not params.greedy:
            sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                        "min_p": params.min_p}
        return GenerationConfig(
            do_sample=not params.greedy,
            **sampling,
            repetition_penalty=params.repetition_penalty,
            typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, no_repeat_ngram_size=0, min_new_tokens=0,
            max_new_tokens=params.max_tokens,
            eos_token_id=eos or None,
            pad_token_id=self.pad_token_id,
            stop_strings=list(params.stop_strings) or None,
            # beam search keeps logits per beam, not per returned sequence: its logprobs come from a forward
            output_logits=self.num_beams == 1,
            return_dict_in_generate=True,
            cache_implementation=self.cache_implementation,
            disable_compile=not self.compile,
            **self.generate_kwargs,
        )

    def _generate_rows(self, rows: Sequence[Sequence[int]], params: SamplingParams, first_row: int) -> list[Completion]:
        device = self.model.get_input_embeddings().weight.device
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, ids in enumerate(rows):  # left padding: every row's last prompt token sits at column width-1
            input_ids[r, width - len(ids) :] = torch.tensor(ids)
            attention_mask[r, width - len(ids) :] = 1
        kwargs = {"tokenizer": self.tokenizer} if params.stop_strings else {}
        images = self._image_inputs(rows, input_ids, device)
        with _seeded(params.seed, first_row, device):
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self._generation_config(params),
                **images,
                **kwargs,
            )
        # a generate the user replaced on the model (cohort.setup.engine) may return the bare sequences
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        tokens = sequences[:, width:].cpu()
        logits = None if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
        if self.num_beams > 1 or logits is None:
            logprobs = self._forward_logprobs(sequences, attention_mask.to(device), width,
                                              params.logprob_temperature, images)
        else:
            logprobs = _chosen_logprobs(logits, tokens, params.logprob_temperature)
        return [self._finish(tokens[r].tolist(), logprobs[r].tolist(), params) for r in range(len(rows))]

    def _image_inputs(self, rows: Sequence[Any], input_ids: torch.Tensor, device) -> dict:
        """The images of the rows that carry some (a VLM's prompts, or conversations a tool added images to), as
        the model's generate takes them for the batch: each key concatenated in row order (Qwen-style processors:
        flattened patches and one grid row per image), plus `mm_token_type_ids` marking the image tokens of the
        prompts (an image-token id the model generates stays text). {} when no row has images."""
        carriers = [r for r in rows if getattr(r, "num_images", 0) and has_extra_inputs([r])]
        if not carriers:
            return {}
        pieces = [r.model_inputs(device) for r in carriers]
        if len(pieces) > 1 and not all(set(p) <= {"pixel_values", "image_grid_thw"} for p in pieces):
            raise ValueError(f"a batch of prompts with images on transformers' generate needs a processor that lays "
                             f"images out as flattened patches with a grid (Qwen2-VL, Qwen2.5-VL, Qwen3.5); this one "
                             f"gives {sorted(pieces[0])}: set generation.generation_batch_size=1")
        out = {k: torch.cat([p[k] for p in pieces], dim=0) for k in pieces[0]}
        token = getattr(getattr(self.model, "config", None), "image_token_id", None)
        if token is not None:
            out["mm_token_type_ids"] = (input_ids == int(token)).long().to(device)
        return out

    @torch.no_grad()
    def _forward_logprobs(self, sequences: torch.Tensor, prompt_mask: torch.Tensor, width: int,
                          temperature: float, images: dict | None = None) -> torch.Tensor:
        """[rows, steps] logprob of each generated token under log_softmax(raw / T), from one forward over the
        left-padded rows (beam search returns sequences whose per-step logits it does not keep). With images,
        the model places them and its own positions (multimodal RoPE) from the attention mask."""
        steps = sequences.shape[1] - width
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(prompt_mask.shape[0], steps)], dim=1)
        if images:
            extra = dict(images)
            if "mm_token_type_ids" in extra:  # the generated tokens are text
                types = extra["mm_token_type_ids"]
                extra["mm_token_type_ids"] = torch.cat([types, types.new_zeros(types.shape[0], steps)], dim=1)
            logits = self.model(input_ids=sequences, attention_mask=mask, **extra).logits
        else:
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = self.model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits
        z = logits[:, width - 1 : -1].float() / temperature
        chosen = sequences[:, width:].unsqueeze(-1)
        return (z.gather(-1, chosen).squeeze(-1) - torch.logsumexp(z, dim=-1)).cpu()

    def _finish(self, tokens: list[int], logprobs: list[float], params: SamplingParams) -> Completion:
        """Cut after the first stop (EOS / stop id / stop string); what follows is generate's padding."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        cut = next((k + 1 for k, t in enumerate(tokens) if t in stop_ids), None)
        if params.stop_strings:
            text_cut = _stop_string_cut(self.tokenizer, tokens[: cut or len(tokens)], params.stop_strings)
            if text_cut is not None:
                cut = text_cut
        if cut is not None:
            return Completion(tokens[:cut], logprobs[:cut], "stop")
        return Completion(tokens, logprobs, "length")


def _cut(c: Completion, max_tokens: int) -> Completion:
    """A completion of a shared batch cut to its own max_tokens (it ends by length when cut)."""
    if len(c.token_ids) <= max_tokens:
        return c
    return Completion(c.token_ids[:max_tokens], c.logprobs[:max_tokens], "length")


def _default_eos(model, tokenizer) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the model's generation config (chat models often have several)."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(gen, "eos_token_id", None)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return tuple(ids)


@contextlib.contextmanager
def _seeded(seed: int | None, offset: int, device: torch.device):
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed + offset)
        yield


def _chosen_logprobs(logits: Sequence[torch.Tensor], tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[rows, steps] logprob of each generated token under log_softmax(raw / T), one step at a time."""
    out = torch.zeros(tokens.shape, dtype=torch.float32)
    for t, step_logits in enumerate(logits):
        z = step_logits.float() / temperature
        chosen = tokens[:, t].to(z.device).unsqueeze(-1)
        out[:, t] = (z.gather(-1, chosen).squeeze(-1) - torch.logsumexp(z, dim=-1)).cpu()
    return out


def _stop_string_cut(tokenizer, tokens: list[int], stop_strings: Sequence[str]) -> int | None:
    """Smallest k such that decode(tokens[:k]) contains a stop string (binary search: containment only grows)."""

    def has_stop(k: int) -> bool:
        text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
        return any(s in text for s in stop_strings)

    if not tokens or not has_stop(len(tokens)):
        return None
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if has_stop(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo

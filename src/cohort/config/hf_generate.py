"""Checks of `generation.hf_generate_kwargs`: options passed through to transformers' `GenerationConfig` when
Hugging Face `generate` samples (generation.engine=hf), e.g. beam sampling, which cohort's engine does not do.

Options that cohort already sets from its own fields (temperature, stop strings, lengths...) or that the engine
needs a fixed value of (logits returned, one sequence per row) are refused with the field to use instead, and an
unknown name is refused with the closest GenerationConfig attribute, all before any model loads.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

from transformers import GenerationConfig  # its attribute names are the accepted keys

from cohort.errors import ConfigError

# GenerationConfig options cohort sets itself, and the setting that controls each.
OWNED = {
    "max_new_tokens": "generation.max_completion_length", "max_length": "generation.max_completion_length",
    "min_new_tokens": "nothing (completions may stop at once)", "temperature": "generation.temperature",
    "top_p": "generation.top_p", "top_k": "generation.top_k", "min_p": "generation.min_p",
    "repetition_penalty": "generation.repetition_penalty", "stop_strings": "generation.stop_strings",
    "do_sample": "generation.temperature (0: greedy)", "eos_token_id": "generation.ignore_eos or the tokenizer",
    "pad_token_id": "the tokenizer", "num_return_sequences": "generation.num_generations",
    "output_logits": "nothing (the engine needs them)", "output_scores": "nothing (the engine needs the logits)",
    "return_dict_in_generate": "nothing (the engine needs it)", "cache_implementation": "nothing",
}


def check_hf_generate_kwargs(kwargs: Any, engine: str, placement: str = "colocate") -> None:
    """Raise ConfigError naming `generation.hf_generate_kwargs`, the key and the fix for a bad entry."""
    name = "generation.hf_generate_kwargs"
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{name}={kwargs!r} is not valid: give a mapping of GenerationConfig options, e.g. "
                          "{num_beams: 2}.")
    if not kwargs:
        return
    if engine != "hf":
        raise ConfigError(f"{name}={kwargs!r} is only used by Hugging Face generate, and generation.engine="
                          f"{engine!r}: set generation.engine=hf (cohort's engine samples without these options) "
                          "or remove them.")
    known = set(GenerationConfig().to_dict())
    if placement == "server":
        raise ConfigError(f"{name}={kwargs!r} needs Hugging Face generate in the trainer, and generation.placement="
                          "'server' samples on a `cohort serve` process with cohort's engine: remove them or set "
                          "generation.placement=colocate.")
    for key, value in kwargs.items():
        if key in OWNED:
            raise ConfigError(f"{name}[{key!r}] is set by cohort: use {OWNED[key]} instead.")
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.7)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{name}[{key!r}] is not a transformers GenerationConfig option{hint}.")
        if not isinstance(value, str | int | float | bool | type(None)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"{name}[{key!r}]={value!r} is not valid: give a number, a string, a boolean or null.")
    beams = kwargs.get("num_beams", 1)
    if not isinstance(beams, int) or isinstance(beams, bool) or beams < 1:
        raise ConfigError(f"{name}['num_beams']={beams!r} is not valid: use a positive whole number of beams.")

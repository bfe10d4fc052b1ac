"""How long prompts and sequences may be in a run: the model's context (generation.max_model_len or the
model's own), the longest completion, the prompt cap that fits beside it, and the length the rollout engine
is sized for. Too little room for a prompt is a ConfigError naming the field to change.
"""

from __future__ import annotations

from cohort.config import CohortConfig
from cohort.errors import ConfigError


def model_context(cfg: CohortConfig, policy) -> int | None:
    """The context limit, prompt + completion: generation.max_model_len, else the model's
    max_position_embeddings (None when the model does not say). A limit above the model's context fails."""
    conf = getattr(policy, "config", None)
    native = getattr(conf, "max_position_embeddings", None)
    native = int(native) if isinstance(native, int) and native > 0 else None
    chosen = cfg.generation.max_model_len
    if chosen is not None and native is not None and chosen > native:
        raise ConfigError(f"generation.max_model_len={chosen} is not valid: the model's context "
                          f"(max_position_embeddings) is {native} tokens; use at most {native}, or leave it unset.")
    return chosen or native


def longest_completion(cfg: CohortConfig) -> int:
    return max(cfg.generation.max_completion_length, cfg.run.eval_max_completion_length or 0)


def prompt_token_limit(cfg: CohortConfig, policy, completion_length: int | None = None) -> int:
    """The longest prompt the run can take: data.max_prompt_length, lowered so the prompt fits the context
    beside `completion_length` (default generation.max_completion_length). Too little room is a ConfigError."""
    context = model_context(cfg, policy)
    completion = completion_length or cfg.generation.max_completion_length
    if context is None:
        return cfg.data.max_prompt_length
    if context - completion < 1:
        field = ("generation.max_completion_length" if completion == cfg.generation.max_completion_length
                 else "run.eval_max_completion_length")
        raise ConfigError(f"{field}={completion} is not valid: it leaves no room for a prompt in the context of "
                          f"{context} tokens (generation.max_model_len or the model's max_position_embeddings); "
                          "lower it (e.g. to a quarter of the context).")
    return min(cfg.data.max_prompt_length, context - completion)


def engine_model_len(cfg: CohortConfig, policy, longest_prompt: int | None = None) -> int | None:
    """What the engine is sized for: the longest prompt (of the encoded data when known, else
    data.max_prompt_length) plus the longest completion, within the context (a smaller max_model_len keeps
    the engine's block tables small, and one sequence must fit its KV cache)."""
    context = model_context(cfg, policy)
    if cfg.generation.max_model_len is not None:
        return context  # asked for: exactly that
    # at least the engine's own default (4096), so data handed in later (the facade's evaluate) still fits
    need = max((longest_prompt or cfg.data.max_prompt_length) + longest_completion(cfg), 4096)
    return need if context is None else min(context, need)


def longest_prompt(*datasets) -> int | None:
    """The longest encoded prompt of the run's data (None when some data is not encoded)."""
    lengths = []
    for data in datasets:
        if data is None:
            continue
        ids = getattr(data, "prompt_ids", None)
        if ids is None:
            return None
        lengths += [len(p) for p in ids]
    return max(lengths) if lengths else None

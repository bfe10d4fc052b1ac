"""How long prompts and sequences may be in a run: the model's context (generation.max_model_len or the
model's own), the longest completion, the prompt cap that fits beside it, and the length the rollout engine
is sized for. Too little room for a prompt is a ConfigError naming the field to change.
"""

from __future__ import annotations

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.policy.context import model_context as native_context


def model_context(cfg: CohortConfig, policy) -> int | None:
    """The context limit, prompt + completion: generation.max_model_len, else the model's own
    (max_position_embeddings or its equivalent, cohort.policy.context; None when the model does not say). A
    limit above the model's context fails."""
    conf = getattr(policy, "config", None)
    native, field = native_context(conf) if conf is not None else (None, "")
    chosen = cfg.generation.max_model_len
    if chosen is not None and native is not None and chosen > native:
        raise ConfigError(f"generation.max_model_len={chosen} is not valid: the model's context "
                          f"({field}) is {native} tokens; use at most {native}, or leave it unset.")
    return chosen or native


def context_error(cfg: CohortConfig, context: int, source: str) -> ConfigError:
    """The longest completion leaves no room for a prompt in `context` tokens (set by `source`): the error names
    the field, its value and the largest completion that leaves data.max_prompt_length for the prompt."""
    completion, prompt = longest_completion(cfg), cfg.data.max_prompt_length
    field = ("generation.max_completion_length" if completion == cfg.generation.max_completion_length
             else "run.eval_max_completion_length")
    fix = (f"the largest that fits beside data.max_prompt_length={prompt} is {context - prompt}" if prompt < context
           else f"the largest that fits is {context - 1}, with a 1-token prompt: lower it and data.max_prompt_length "
                f"so that the two fit in {context}, e.g. {3 * context // 4} and {context // 4}")
    return ConfigError(f"{field}={completion} plus data.max_prompt_length={prompt} exceeds the model's context of "
                       f"{context} tokens ({source}); {fix}.")


def longest_completion(cfg: CohortConfig) -> int:
    return max(cfg.generation.max_completion_length, cfg.run.eval_max_completion_length or 0)


def prompt_token_limit(cfg: CohortConfig, policy, completion_length: int | None = None) -> int:
    """The longest prompt the run can take: data.max_prompt_length, lowered so the prompt fits the context
    beside `completion_length` (default generation.max_completion_length). Too little room is a ConfigError."""
    context = model_context(cfg, policy)
    completion = completion_length or cfg.generation.max_completion_length
    if context is None:
        return cfg.data.max_prompt_length
    if context - longest_completion(cfg) < 1:  # checked before the load where the config could be read
        raise context_error(cfg, context, "generation.max_model_len" if cfg.generation.max_model_len
                            else "the model's own")
    return min(cfg.data.max_prompt_length, context - completion)


def engine_model_len(cfg: CohortConfig, policy, longest_prompt: int | None = None) -> int | None:
    """What the engine is sized for: the longest prompt the run can take (the prompt cap beside the longest
    completion, or the encoded data's longest when that is longer) plus the longest completion, within the
    context: no more (the block tables and the one sequence that must fit the KV pool stay as small as the run
    needs), and no less than data handed in later (the facade's evaluate, capped at the same prompt limit)
    takes."""
    context = model_context(cfg, policy)
    if cfg.generation.max_model_len is not None:
        return context  # asked for: exactly that
    completion = longest_completion(cfg)
    cap = prompt_token_limit(cfg, policy, completion)
    need = max(longest_prompt or 0, cap) + completion
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

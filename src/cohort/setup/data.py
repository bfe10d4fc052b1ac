"""The prompts of a run: the training set and the held-out set (an eval source, a reasoning-gym generator past
the training items, or a split), with overlap removed, encoded within the prompt limit of
`cohort.setup.lengths`; data handed in (facade, tests) is fitted to that limit too. Too few prompts for a step
is a ConfigError.
"""

from __future__ import annotations

from typing import Any

from cohort.config import CohortConfig
from cohort.data import drop_overlap, load_prompt_dataset, reasoning_gym_eval_set, train_eval_split
from cohort.errors import ConfigError
from cohort.setup.lengths import longest_completion, model_context, prompt_token_limit
from cohort.vision.setup import encode_dataset


def load_run_data(cfg: CohortConfig, tokenizer, echo, tools=None, policy=None, processor=None):
    """(train, eval) from the `data` section, encoded; eval is None without eval_source or eval_size."""
    d = cfg.data
    common: dict[str, Any] = {"prompt_column": d.prompt_column, "system_prompt": d.system_prompt,
                              "few_shot": d.few_shot}
    train = load_prompt_dataset(d.source, split=d.split, **common, **d.options)
    if d.eval_source:
        evald = load_prompt_dataset(d.eval_source, **common, **d.eval_options)
        # never train on a prompt that is scored; the eval set stays whole (it is the benchmark)
        train, overlap = drop_overlap(train, evald)
        if overlap:
            echo(f"data: removed {overlap} training prompts that also occur in the eval set")
    elif d.eval_size and str(d.source).startswith("reasoning_gym:"):
        # reasoning-gym seeds item i with seed + i: a fresh generator past the training items, not a split
        task = str(d.source).split(":", 1)[1]
        settings = {k: v for k, v in d.options.items() if k not in ("size", "seed")}
        evald, train, overlap = reasoning_gym_eval_set(task, d.eval_size, train,
                                                       train_seed=d.options.get("seed", 0), **common, **settings)
        if overlap:
            echo(f"data: removed {overlap} training problems equal to a held-out one")
    elif d.eval_size:
        train, evald = train_eval_split(train, d.eval_size, seed=cfg.train.seed)
    else:
        evald = None
    # with tools, the chat template lists their schemas in the prompt (apply_chat_template(..., tools=...))
    kwargs = {"chat_template_kwargs": {"tools": [t.schema for t in tools]}} if tools else {}
    train_limit = prompt_token_limit(cfg, policy)
    eval_limit = prompt_token_limit(cfg, policy, longest_completion(cfg))
    if train_limit < d.max_prompt_length:
        echo(f"data: prompts capped at {train_limit} tokens (data.max_prompt_length={d.max_prompt_length}, lowered "
             f"to the context {model_context(cfg, policy)} - generation.max_completion_length="
             f"{cfg.generation.max_completion_length}); longer ones: data.truncation={d.truncation}")
    name = cfg.model.name_or_path
    train = encode_dataset(train, tokenizer, processor, policy, train_limit, d.truncation, model_name=name, **kwargs)
    if evald is not None:
        evald = encode_dataset(evald, tokenizer, processor, policy, eval_limit, d.truncation, model_name=name,
                               **kwargs)
        if cfg.run.eval_max_prompts:
            evald = evald.head(cfg.run.eval_max_prompts)
    echo(f"data: {len(train)} training prompts" + (f", {len(evald)} held-out" if evald is not None else "")
         + f"; {train.stats_line()}")
    if len(train) < cfg.train.prompts_per_step:
        raise ConfigError(f"data.source={d.source!r} gave {len(train)} prompts, fewer than "
                          f"train.prompts_per_step={cfg.train.prompts_per_step}; use more data or fewer prompts.")
    return train, evald


def fit_to_context(cfg: CohortConfig, policy, train_data, eval_data, echo):
    """Handed-in encoded data: prompts that cannot fit beside the completion are dropped or truncated
    (data.truncation), as `load_run_data` does for the data it loads."""
    out = []
    for data, limit in ((train_data, prompt_token_limit(cfg, policy)),
                        (eval_data, prompt_token_limit(cfg, policy, longest_completion(cfg)))):
        if getattr(data, "prompt_ids", None) is not None and hasattr(data, "fit"):
            fitted = data.fit(limit, cfg.data.truncation)
            if fitted is not data:
                echo(f"data: prompts longer than {limit} tokens (the context {model_context(cfg, policy)} minus the "
                     f"completion length) {'dropped' if cfg.data.truncation == 'drop' else 'truncated'}; "
                     f"{fitted.stats_line()}")
            data = fitted
        out.append(data)
    return out[0], out[1]

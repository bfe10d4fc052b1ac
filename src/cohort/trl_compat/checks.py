"""What TRL's `GRPOTrainer.__init__` checks, normalises and warns about before any weights load, with TRL's
exception types and wording (its own tests and users' code match on them), in cohort's one-line form.

- `check_sources`: a reward source (reward_funcs, or an environment with get_reward) and a data source
  (train_dataset, or an environment_factory whose reset() supplies the prompts, with max_steps set);
  `reward_processing_classes` and `reward_weights` as long as `reward_funcs`.
- `normalise_args`: as TRL does to its `args`, `accelerator_config` becomes transformers' `AcceleratorConfig`,
  iterable datasets need `dispatch_batches=False` (set when unset, an error when True), and an iterable train
  set is read with `dataloader_num_workers=0`.
- `warn_like_trl`: TRL's construction-time warnings (logger `cohort.trl_compat`, TRL's text).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers.trainer_pt_utils import AcceleratorConfig

from cohort.errors import ConfigError

log = logging.getLogger("cohort.trl_compat")

_TOKEN_SUMMED = ("bnpo", "dr_grpo", "dapo", "cispo")


def is_iterable_dataset(data: Any) -> bool:
    """A streaming `datasets.IterableDataset` (or a dict of them, for eval_dataset)."""
    if isinstance(data, dict):
        return any(is_iterable_dataset(v) for v in data.values())
    return type(data).__name__ == "IterableDataset"


def environment_rewards(environment_factory: Any) -> bool:
    """Whether an environment factory's class (or any of a dict's) defines get_reward."""
    if environment_factory is None:
        return False
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    return any(callable(getattr(f, "get_reward", None)) for f in factories if isinstance(f, type))


def check_sources(args, train_dataset: Any, reward_funcs: list, reward_processing_classes: Any,
                  environment_factory: Any) -> None:
    """TRL's ValueErrors for a missing reward or data source and for lists of the wrong length."""
    if not reward_funcs and not environment_rewards(environment_factory):
        raise ValueError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                         "environment defines a `get_reward` method.")
    if train_dataset is None:
        if environment_factory is None:
            raise ValueError("`train_dataset` is required unless an `environment_factory` is provided.")
        if isinstance(environment_factory, dict):
            raise ValueError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with "
                             "an `environment` column to route each example to its environment. Provide a dataset, "
                             "or pass a single environment factory.")
        if args.max_steps <= 0:
            raise ValueError("When training without a `train_dataset` (the environment owns the data and returns the "
                             "prompt from `reset()`), `max_steps` must be set to a positive value to define the "
                             "training length. Set it via `GRPOConfig(max_steps=...)`.")
    if args.reward_weights is not None and len(args.reward_weights) != len(reward_funcs):
        raise ValueError(f"Number of reward weights ({len(args.reward_weights)}) must match number of reward "
                         f"functions ({len(reward_funcs)}): GRPOConfig(reward_weights=...) takes one per function.")
    classes = processing_class_list(reward_processing_classes, len(reward_funcs))
    if len(classes) != len(reward_funcs):
        raise ValueError(f"The number of reward processing classes ({len(classes)}) must match the number of reward "
                         f"functions ({len(reward_funcs)}): pass one per reward function (None for a function).")


def check_ref_sync(args, peft_config: Any) -> None:
    """sync_ref_model needs a reference model to update: TRL's errors for beta=0 and for PEFT."""
    if not args.sync_ref_model:
        return
    if args.beta == 0.0:
        raise ValueError("You passed `sync_ref_model=True` while `beta=0.0`, which means the reference model is not "
                         "used during training. Consequently, GRPOTrainer does not create a `ref_model` instance, "
                         "and there is nothing to synchronize. Please set `sync_ref_model=False`, or set `beta` to a "
                         "non-zero value.")
    if peft_config is not None:
        raise ValueError("You passed `sync_ref_model=True` while using a PEFT model, which is currently not "
                         "supported. With PEFT, the reference is the base model with the adapters disabled, so "
                         "there is no separate `ref_model` instance to synchronize. Use `sync_ref_model=False`.")


def check_rows(rows: list[dict], prompt_column: str, what: str = "train_dataset") -> None:
    """A dataset with no rows, or rows without the prompt column, fails here, before any weights load."""
    if not rows:
        raise ConfigError(f"{what} has no rows: GRPO needs prompts to sample completions for; pass a dataset with a "
                          f"{prompt_column!r} column.")
    missing = next((row for row in rows if prompt_column not in row), None)
    if missing is not None:
        raise ConfigError(f"{what} has no {prompt_column!r} column (a row has {sorted(missing)}): rename the column "
                          f"that holds the prompts to {prompt_column!r}, e.g. dataset.rename_column('question', "
                          f"{prompt_column!r}).")


def processing_class_list(reward_processing_classes: Any, n: int) -> list:
    """TRL's normal form: None -> [None] * n, one object -> [it], a list as it is."""
    if reward_processing_classes is None:
        return [None] * n
    if not isinstance(reward_processing_classes, list | tuple):
        return [reward_processing_classes]
    return list(reward_processing_classes)


def placeholder_rows(args) -> list[dict]:
    """TRL's rows for environment-owned data: one generation round of empty conversational prompts, cycled; the
    environment's reset() supplies each rollout's prompt."""
    generation_batch, _ = args._batch()
    return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(generation_batch // args.num_generations)]


def normalise_args(args, train_dataset: Any, eval_dataset: Any) -> None:
    """TRL's changes to `args` at construction (see the module docstring)."""
    config = args.accelerator_config
    if not isinstance(config, AcceleratorConfig):
        args.accelerator_config = AcceleratorConfig(**(config or {}))
    if is_iterable_dataset(train_dataset) or is_iterable_dataset(eval_dataset):
        if args.accelerator_config.dispatch_batches:
            raise ValueError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                             "`accelerator_config`. Please set it to `False`.")
        args.accelerator_config.dispatch_batches = False
    if is_iterable_dataset(train_dataset) and args.dataloader_num_workers != 0:
        log.warning("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding the "
                    "provided value (%s).", args.dataloader_num_workers)
        args.dataloader_num_workers = 0


def warn_like_trl(args) -> None:
    """The warnings TRL's constructor logs for a loss type and importance-sampling level that do not fit."""
    level, loss = args.importance_sampling_level, args.loss_type
    if loss == "luspo" and level != "sequence":
        log.warning("When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'` to mirror "
                    "the paper's setup.")
    if loss == "vespo" and level != "token":
        log.warning("VESPO computes sequence-level importance weights internally. `importance_sampling_level` should "
                    "be set to `'token'` (the default).")
    if level == "sequence" and loss in _TOKEN_SUMMED:
        log.warning("When using `importance_sampling_level='sequence'`, the `'%s'` loss sums per-token contributions, "
                    "which effectively weights each sequence by its completion length instead of optimizing the "
                    "per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'`.", loss)

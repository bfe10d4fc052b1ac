"""`GRPOConfig`: TRL 1.16's fields and defaults (from `fields.TABLE`), turned into one `CohortConfig`.

TRL's batch arithmetic is kept: `generation_batch_size` completions (= per_device_train_batch_size x ranks x
steps_per_generation) are sampled per generation, i.e. generation_batch_size / num_generations prompts (one
cohort step); each optimiser step sees per_device_train_batch_size x ranks x gradient_accumulation_steps
completions, so a cohort step makes steps_per_generation / gradient_accumulation_steps x num_iterations
optimiser steps. `max_steps`, `logging_steps`, `save_steps`, `eval_steps` count optimiser steps, as in TRL.

This module is the config object itself: its fields and their command-line types, the checks made when it is
built (rejected and announced values, the batch arithmetic) and `to_cohort`, which copies the mapped fields
and hands each "derived" field to its conversion in `derived.py`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import math
from typing import TYPE_CHECKING, Any

from cohort import distributed
from cohort.algorithms import policy_loss_parameters
from cohort.config import CohortConfig
from cohort.config.overrides import _set
from cohort.errors import ConfigError
from cohort.trl_compat.derived import DERIVED
from cohort.trl_compat.fields import TABLE, kind

log = logging.getLogger("cohort.trl_compat")


class _GRPOConfigBase:
    """Methods of `GRPOConfig`; its fields come from `fields.TABLE` (TRL 1.16's names and defaults)."""

    if TYPE_CHECKING:  # the fields are made at run time (make_dataclass below): any name, any value
        scale_rewards: bool | str

        def __init__(self, **fields: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __post_init__(self) -> None:
        for name in _JSON_FIELDS:  # a command line gives dicts as JSON strings (TRL parses them the same way)
            value = getattr(self, name)
            if isinstance(value, str) and value.lstrip().startswith("{"):
                setattr(self, name, json.loads(value))
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = self.scale_rewards.lower() == "true"
        for name, (default, status) in TABLE.items():
            value = getattr(self, name)
            if _same(value, default):
                continue
            k = kind(status)
            if k == "reject":
                raise ConfigError(f"GRPOConfig({name}={value!r}) is not supported by cohort: "
                                  f"{status.split(':', 1)[1].strip()}.")
            if k == "announce":
                log.warning("GRPOConfig(%s=%r): %s.", name, value, status.split(":", 1)[1].strip())
        if self.num_generations < 2:  # TRL's check and wording (ConfigError is a ValueError)
            raise ConfigError(f"GRPOConfig(num_generations={self.num_generations}): GRPO requires at least 2 "
                              "generations per prompt to calculate the advantages; set num_generations >= 2.")
        self._batch()  # TRL checks the batch arithmetic when the config is made; so does this

    @classmethod
    def from_trl(cls, trl_args: Any) -> _GRPOConfigBase:
        """cohort's GRPOConfig from a `trl.GRPOConfig` object, field by field through the same table.

        TRL's __post_init__ resolves some defaults (enums, report_to -> [], pad_to_multiple_of, bf16,
        generation_batch_size, ...); a field still equal to what TRL resolves its default to stays at the
        default here, so only the values the user set are mapped, announced or rejected. bf16 is taken as
        TRL resolved it (None -> True), and steps_per_generation carries the batch split.
        """
        # the same script's config with only the fields that steer TRL's resolution: its resolved defaults
        steering = ("output_dir", "use_cpu", "bf16", "fp16")
        reference = type(trl_args)(**{name: getattr(trl_args, name) for name in steering})
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(trl_args):
            if f.name not in TABLE:
                raise ConfigError(f"trl.GRPOConfig has a field {f.name!r} this cohort does not know (it follows "
                                  "TRL 1.16); build cohort's GRPOConfig instead.")
            value = getattr(trl_args, f.name)
            if f.name == "generation_batch_size" or (f.name not in (*steering, "steps_per_generation")
                                                      and _same(value, getattr(reference, f.name))):
                continue
            kwargs[f.name] = getattr(value, "value", value)  # enums as their strings
        return cls(**kwargs)

    # ----------------------------------------------------------------------------------------- batches
    def _batch(self) -> tuple[int, int]:
        """(generation_batch_size, steps_per_generation) as TRL's __post_init__ resolves them."""
        world = distributed.world_size_from_env()  # a ConfigError, not a traceback, for WORLD_SIZE=two
        per_step = self.per_device_train_batch_size * world
        gen, spg = self.generation_batch_size, self.steps_per_generation
        if gen is not None and spg is not None:
            raise ConfigError("GRPOConfig: 'generation_batch_size' and 'steps_per_generation' can not be both "
                              "configured at the same time (as in TRL); set one.")
        if gen is None:
            spg = spg or self.gradient_accumulation_steps
            gen = per_step * spg
        elif gen % per_step:
            raise ConfigError(f"GRPOConfig: generation_batch_size={gen} must be divisible by the global batch size "
                              f"per_device_train_batch_size x ranks = {per_step}.")
        else:
            spg = gen // per_step
        if gen % self.num_generations:
            raise ConfigError(f"GRPOConfig: generation_batch_size={gen} must be a multiple of num_generations="
                              f"{self.num_generations}; change per_device_train_batch_size or steps_per_generation.")
        if spg % self.gradient_accumulation_steps:
            raise ConfigError(f"GRPOConfig: steps_per_generation={spg} must be a multiple of "
                              f"gradient_accumulation_steps={self.gradient_accumulation_steps}: cohort's optimiser "
                              "steps never span two generations.")
        return gen, spg

    def updates_per_generation(self) -> int:
        """Optimiser steps per cohort step (one generation): steps_per_generation / ga x num_iterations."""
        _, spg = self._batch()
        return spg // self.gradient_accumulation_steps * self.num_iterations

    def optimizer_steps(self, num_rows: int | None = None) -> int:
        """TRL's max_steps: `max_steps` when > 0, else num_train_epochs over `num_rows` prompts, counted as
        transformers counts them for TRL's RepeatSampler (whole generation batches per epoch)."""
        if self.max_steps > 0:
            return int(self.max_steps)
        if num_rows is None:
            raise ConfigError("GRPOConfig(max_steps=-1) counts steps from num_train_epochs and the dataset's length; "
                              "a streaming (iterable) dataset has none: set max_steps, as TRL requires.")
        gen, spg = self._batch()
        prompts_per_gen = gen // self.num_generations
        generations = num_rows // prompts_per_gen
        if generations == 0:
            raise ConfigError(f"train_dataset has {num_rows} prompts, fewer than one generation batch "
                              f"({prompts_per_gen} prompts); add rows or lower per_device_train_batch_size.")
        batches = generations * spg * self.num_iterations
        per_epoch = max(1, math.ceil(batches / self.gradient_accumulation_steps))
        return max(1, math.ceil(self.num_train_epochs * per_epoch))

    # ----------------------------------------------------------------------------------------- mapping
    def to_cohort(self, num_rows: int | None = None) -> CohortConfig:
        """The cohort config this TRL config means (`num_rows`: the dataset's length, for num_train_epochs)."""
        cfg = CohortConfig()
        for name, (_, status) in TABLE.items():
            if kind(status) == "mapped" and not status.startswith("loss."):
                _set(cfg, status, copy.deepcopy(getattr(self, name)))
        _loss(self, cfg)
        gen, spg = self._batch()
        per_gen = self.updates_per_generation()
        total = self.optimizer_steps(num_rows)
        t, r = cfg.train, cfg.run
        t.prompts_per_step = gen // self.num_generations
        t.mini_batches = spg // self.gradient_accumulation_steps
        t.max_steps = max(1, math.ceil(total / per_gen))
        for name, convert in DERIVED.items():
            convert(self, cfg, getattr(self, name), per_gen=per_gen, total=total)
        r.output_dir = self.output_dir or "trainer_output"
        _set_extra(cfg, self.extra)
        return cfg


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default) and isinstance(value, bool) == isinstance(default, bool)
    except Exception:  # (objects without a boolean ==, e.g. a ParallelismConfig)
        return False


def _loss(args, cfg: CohortConfig) -> None:
    """loss.* fields reach the loss only where it has that parameter (TRL's losses read only their own) and
    only when they differ from the loss's own default; TRL's epsilon_high=None means epsilon."""
    cfg.loss.loss_type = args.loss_type
    try:
        owned = policy_loss_parameters(args.loss_type)
    except Exception:  # (a user loss by import path: pass everything, it checks its own)
        owned = None
    values = {status.split(".", 1)[1]: getattr(args, name) for name, (_, status) in TABLE.items()
              if kind(status) == "mapped" and status.startswith("loss.") and name != "loss_type"}
    if args.epsilon_high is None and owned is not None and "epsilon_high" in owned and "epsilon" not in owned:
        values["epsilon_high"] = args.epsilon  # cispo: TRL caps the ratio at epsilon_high or else epsilon
    for key, value in values.items():
        if value is None or (owned is not None and (key not in owned or _same(value, owned[key]))):
            continue
        _set(cfg, f"loss.{key}", value)


def _set_extra(cfg: CohortConfig, extra: dict[str, Any]) -> None:
    for key, value in (extra or {}).items():
        _set(cfg, key, value)


# TRL's annotations where the default's type does not say it (None defaults, unions), so transformers'
# HfArgumentParser / TRL's TrlParser build the same command line from cohort's GRPOConfig as from TRL's.
# Enums (SchedulerType, IntervalStrategy, ...) are their string values here.
_TYPES: dict[str, Any] = {
    **dict.fromkeys(["output_dir", "optim_args", "torch_compile_backend", "torch_compile_mode", "run_name",
                     "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id", "hub_token", "hub_model_id",
                     "hub_revision", "metric_for_best_model", "dataloader_multiprocessing_context", "ddp_backend",
                     "fsdp", "resume_from_checkpoint", "cache_implementation", "vllm_structured_outputs_regex",
                     "vllm_server_base_url", "log_completions_hub_repo", "parallelism_config"], str | None),
    **dict.fromkeys(["lr_scheduler_type", "optim", "logging_strategy", "eval_strategy", "save_strategy",
                     "hub_strategy", "include_num_input_tokens_seen", "debug"], str),
    **dict.fromkeys(["warmup_steps", "logging_steps", "eval_delay", "save_steps"], float),
    **dict.fromkeys(["lr_scheduler_kwargs", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs",
                     "accelerator_config", "fsdp_config", "deepspeed", "model_init_kwargs", "generation_kwargs",
                     "chat_template_kwargs", "transformers_continuous_batching_config", "liger_kernel_config"],
                    dict | str | None),
    **dict.fromkeys(["bf16", "tf32", "activation_checkpointing", "disable_tqdm", "hub_private_repo",
                     "greater_is_better", "ddp_find_unused_parameters", "ddp_broadcast_buffers", "ddp_static_graph"],
                    bool | None),
    **dict.fromkeys(["torch_empty_cache_steps", "eval_accumulation_steps", "save_total_limit", "data_seed",
                     "dataloader_prefetch_factor", "ddp_bucket_cap_mb", "num_generations_eval",
                     "generation_batch_size", "steps_per_generation", "vllm_max_model_length",
                     "max_tool_calling_iterations", "num_completions_to_print", "max_prompt_length"], int | None),
    **dict.fromkeys(["neftune_noise_alpha", "eval_steps", "router_aux_loss_coef", "min_p", "delta", "epsilon_high",
                     "vllm_importance_sampling_clip_min", "off_policy_mask_threshold", "vllm_importance_sampling_cap",
                     "warmup_ratio"], float | None),
    "optim_target_modules": None | str | list[str], "report_to": None | str | list[str],
    "label_names": list[str] | None, "reward_weights": list[float] | None, "pad_to_multiple_of": int | str | None,
    "include_for_metrics": list[str], "scale_rewards": str, "extra": dict,
}
_JSON_FIELDS = [name for name, t in _TYPES.items() if t == dict | str | None]


def _type(name: str, default: Any) -> Any:
    return _TYPES.get(name, type(default))


def _field(default: Any) -> Any:
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default))
    return dataclasses.field(default=default)


GRPOConfig: type[_GRPOConfigBase] = dataclasses.make_dataclass(
    "GRPOConfig", [(name, _type(name, default), _field(default)) for name, (default, _) in TABLE.items()],
    bases=(_GRPOConfigBase,))
GRPOConfig.__module__ = __name__
GRPOConfig.__doc__ = ("TRL 1.16's GRPOConfig, field by field with TRL's defaults; see "
                      "cohort.trl_compat.fields.TABLE (and docs/trl_compat.md) for what each one does here.")

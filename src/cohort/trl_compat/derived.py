"""Conversions of GRPOConfig's "derived" fields: the TRL fields that are not one-to-one copies onto cohort's config.

`fields.TABLE` marks a field "derived: <how>"; `DERIVED` holds, for each such field, the function that applies
it: `convert(args, cfg, value, *, per_gen, total)`, where `args` is the GRPOConfig, `cfg` the CohortConfig being
built, `per_gen` the optimiser steps per cohort step and `total` the run's optimiser steps (step counts in TRL's
units are turned into cohort steps here). A conversion may also raise ConfigError for a value cohort cannot run.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from cohort.algorithms import policy_loss_parameters
from cohort.config.overrides import _set
from cohort.errors import ConfigError
from cohort.remote.client import parse_address
from cohort.trl_compat.fields import TABLE, kind

log = logging.getLogger("cohort.trl_compat")


def _in_steps(count: float, per_gen: int) -> int:
    return max(1, math.ceil(count / per_gen))


def _scheduler(a, cfg, value, **_):
    cfg.train.lr_scheduler_type = {"constant": "hf:constant", "cosine": "hf:cosine"}.get(value, value)
    cfg.train.lr_scheduler_kwargs = dict(a.lr_scheduler_kwargs or {})


def _warmup(a, cfg, value, *, total, **_):
    ratio = a.warmup_ratio if a.warmup_ratio is not None else (value if 0 < value < 1 else None)
    cfg.train.warmup_steps = math.ceil(total * ratio) if ratio is not None else int(value)


def _optim(a, cfg, value, **_):
    if str(value) not in ("adamw_torch", "adamw_torch_fused"):
        raise ConfigError(f"GRPOConfig(optim={value!r}) is not supported by cohort: its optimiser is AdamW "
                          "(optim='adamw_torch' or 'adamw_torch_fused').")


def _bf16(a, cfg, value, **_):
    cfg.model.dtype = {None: "auto", True: "bfloat16", False: "float32"}[value]


def _activation_checkpointing(a, cfg, value, **_):
    if value is not None:
        cfg.model.gradient_checkpointing = bool(value)


def _strategy(field_name: str, allowed: tuple[str, ...], hint: str):
    def check(a, cfg, value, **_):
        if str(getattr(value, "value", value)) not in allowed:
            raise ConfigError(f"GRPOConfig({field_name}={value!r}) is not supported by cohort: use "
                              f"{' or '.join(map(repr, allowed))}; {hint}.")
    return check


def _logging_steps(a, cfg, value, *, per_gen, total, **_):
    if str(getattr(a.logging_strategy, "value", a.logging_strategy)) == "no":
        cfg.run.logging_steps = 0  # no on_log rows but the closing one, as TRL
        return
    steps = math.ceil(total * value) if 0 < value < 1 else value
    cfg.run.logging_steps = _in_steps(steps, per_gen)


def _report_to(a, cfg, value, **_):
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n.strip() for item in names for n in str(item).split(",") if n.strip()]
    if str(getattr(a.logging_strategy, "value", a.logging_strategy)) == "no":
        cfg.run.report_to = ["console"]  # logging_strategy="no": cohort's step lines only
        return
    if names == ["all"]:
        cfg.run.report_to = ["all"]
        return
    cfg.run.report_to = list(dict.fromkeys(["console", "jsonl"] + [n for n in names if n != "none"]))


def _eval_steps(a, cfg, value, *, per_gen, total, **_):
    strategy = str(getattr(a.eval_strategy, "value", a.eval_strategy))
    if strategy != "steps":
        cfg.run.eval_steps = 0
        return
    steps = value if value is not None else a.logging_steps
    steps = math.ceil(total * steps) if 0 < steps < 1 else steps
    cfg.run.eval_steps = _in_steps(steps, per_gen)


def _save_steps(a, cfg, value, *, per_gen, total, **_):
    strategy = str(getattr(a.save_strategy, "value", a.save_strategy))
    steps = math.ceil(total * value) if 0 < value < 1 else value
    cfg.run.save_steps = 0 if strategy == "no" else _in_steps(steps, per_gen)
    cfg.run.save_at_end = strategy != "no"  # TRL: no checkpoint at all, only an explicit save_model()


def _use_cpu(a, cfg, value, **_):
    if value:
        cfg.train.device = "cpu"


def _fsdp(a, cfg, value, **_):
    if value:
        cfg.train.sharding = "fsdp"


def _eval_samples(a, cfg, value, **_):
    if value is not None:
        cfg.run.eval_num_samples = int(value)


def _min_p(a, cfg, value, **_):
    cfg.generation.min_p = float(value or 0.0)


_GENERATION_KWARGS = {"stop_strings": "stop_strings", "max_new_tokens": "max_completion_length",
                      "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos"}


def _generation_kwargs(a, cfg, value, **_):
    """TRL hands generation_kwargs to transformers' GenerationConfig. Those cohort's engine has (sampling knobs,
    stops, lengths) map to generation.*; any other GenerationConfig option (num_beams > 1: beam sampling,
    length_penalty, no_repeat_ngram_size, ...) makes transformers' generate sample, as it does in TRL without vLLM:
    generation.engine=hf with the options in generation.hf_generate_kwargs, announced. A name that is no
    GenerationConfig option is refused when the config is checked."""
    passthrough: dict[str, Any] = {}
    for key, v in (value or {}).items():
        if key == "do_sample":  # cohort's engine samples; do_sample=False is greedy decoding (temperature 0)
            if not v:
                cfg.generation.temperature = 0.0
            continue
        if key == "num_beams" and v in (None, 1):  # one beam: plain sampling, what the engine does
            continue
        if key not in _GENERATION_KWARGS:
            passthrough[key] = v
            continue
        if key == "stop_strings" and isinstance(v, str):
            v = [v]
        setattr(cfg.generation, _GENERATION_KWARGS[key], v)
    if passthrough:
        log.warning("GRPOConfig(generation_kwargs=%r): cohort's engine has no %s, so transformers' generate samples "
                    "the completions (generation.engine='hf', as TRL without vLLM; slower than cohort's engine).",
                    passthrough, ", ".join(sorted(passthrough)))
        cfg.generation.engine = "hf"
        cfg.generation.hf_generate_kwargs = passthrough


def _scale(a, cfg, value, **_):
    cfg.advantage.scale_rewards = {True: "group", False: "none"}.get(value, value)


def _is_mode(a, cfg, value, **_):
    if a.loss_type == "vespo" and not str(value).startswith("token"):
        return  # TRL requires a token-level mode with vespo; cohort's vespo defaults to token_truncate
    try:
        default = policy_loss_parameters(a.loss_type).get("sampler_is_mode")
    except Exception:  # a user loss by import path
        default = None
    if a.vllm_importance_sampling_correction and value != default:
        _set(cfg, "loss.sampler_is_mode", value)


def _is_cap(a, cfg, value, **_):
    if value is not None:
        _set(cfg, "loss.sampler_is_clip_max", value)


def _vllm(a, cfg, value, **_):
    """TRL's server mode (use_vllm=True, vllm_mode='server') -> generation.placement=server at the same address."""
    mode = str(a.vllm_mode)
    if mode not in ("colocate", "server"):
        raise ConfigError(f"GRPOConfig(vllm_mode={mode!r}) is not supported: use 'colocate' or 'server'.")
    if not (value and mode == "server"):
        return
    if a.vllm_server_base_url:
        host, port = parse_address(a.vllm_server_base_url)
    else:
        host = "127.0.0.1" if a.vllm_server_host in ("0.0.0.0", "") else a.vllm_server_host
        port = int(a.vllm_server_port)
    cfg.generation.placement, cfg.generation.server_address = "server", f"{host}:{port}"


def _max_prompt_length(a, cfg, value, **_):
    cfg.data.max_prompt_length = int(value) if value is not None else 10**9


def _router_aux(a, cfg, value, **_):
    """TRL's router_aux_loss_coef, None included (the model's own coefficient): not a parameter of the policy loss,
    so it is copied here rather than by the loss.* mapping, which keeps only the chosen loss's own parameters."""
    cfg.loss.router_aux_loss_coef = None if value is None else float(value)


def _noop(*_, **__):  # fields whose effect is computed elsewhere in to_cohort (batch arithmetic, steps)
    pass


DERIVED: dict[str, Any] = {
    "output_dir": _noop, "per_device_train_batch_size": _noop, "num_train_epochs": _noop, "max_steps": _noop,
    "gradient_accumulation_steps": _noop, "generation_batch_size": _noop, "steps_per_generation": _noop,
    "extra": _noop,
    "lr_scheduler_type": _scheduler, "lr_scheduler_kwargs": _noop, "warmup_steps": _warmup, "warmup_ratio": _noop, "optim": _optim,
    "bf16": _bf16, "activation_checkpointing": _activation_checkpointing,
    "logging_strategy": _strategy("logging_strategy", ("steps", "no"), "set logging_steps"),
    "logging_steps": _logging_steps, "report_to": _report_to,
    "eval_strategy": _strategy("eval_strategy", ("steps", "no"), "set eval_steps"),
    "eval_steps": _eval_steps,
    "save_strategy": _strategy("save_strategy", ("steps", "no"), "set save_steps"),
    "save_steps": _save_steps, "use_cpu": _use_cpu, "fsdp": _fsdp, "num_generations_eval": _eval_samples,
    "min_p": _min_p, "generation_kwargs": _generation_kwargs, "scale_rewards": _scale,
    "vllm_importance_sampling_mode": _is_mode, "vllm_importance_sampling_cap": _is_cap,
    "max_prompt_length": _max_prompt_length, "router_aux_loss_coef": _router_aux, "use_vllm": _vllm, "vllm_mode": _noop,
    "vllm_server_base_url": _noop, "vllm_server_host": _noop, "vllm_server_port": _noop,
}


_missing = {name for name, (_, status) in TABLE.items() if kind(status) == "derived"} - set(DERIVED)
assert not _missing, f"derived fields without a conversion: {_missing}"

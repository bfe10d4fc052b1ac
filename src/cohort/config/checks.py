"""Field checks of a `CohortConfig`: every range, enum and cross-field rule, each error naming the field, the
value and the fix (issue 14). cohort.config.validation calls `validate_fields`; the helpers are shared with it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import SchedulerType

from cohort.algorithms import ESTIMATORS, build_advantage_estimator
from cohort.config.hf_generate import check_hf_generate_kwargs
from cohort.config.parity import check_logprob_parity
from cohort.errors import ConfigError
from cohort.remote.address import parse_address
from cohort.resolve import is_import_path
from cohort.run.logging import resolve_report_to

if TYPE_CHECKING:
    from cohort.config.tree import CohortConfig


def _scheduler_names() -> list[str]:
    return ["constant", "cosine"] + [s.value for s in SchedulerType if s.value not in ("constant", "cosine")]


def _require(ok: bool, name: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is not valid: {fix}.")


def _require_choice(name: str, value: Any, choices: Sequence[Any], what: str = "") -> None:
    """An enum field: the value must be one of `choices`; a near miss gets "did you mean"."""
    if value in choices:
        return
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(f"{name}={value!r} is not valid: {hint}use one of "
                      f"{', '.join(repr(c) for c in choices)}{what}.")


def _is_message(m: Any) -> bool:
    """A chat message as chat templates take it: a role and text content (assistant turns may have tool_calls)."""
    return (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
            and isinstance(m.get("content", ""), str) and isinstance(m.get("tool_calls", []), list))


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


_DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
_SCALE_REWARDS = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def validate_fields(cfg: CohortConfig) -> None:
    """Every range, enum and cross-field rule of the config (issue 14): checked before any model, data or run
    directory is touched. Each failure names the field, the value and the fix. One section at a time, in
    config order."""
    _check_model(cfg)
    _check_quantization(cfg)
    _check_data(cfg)
    _check_generation(cfg)
    check_logprob_parity(cfg)
    _check_reward(cfg)
    _check_advantage(cfg)
    _check_router_aux_loss(cfg)
    _check_router_replay(cfg)
    _check_train(cfg)
    _check_run(cfg)


def _check_model(cfg: CohortConfig) -> None:
    """model: dtype, packed attention, the LoRA settings (with lora_r > 0) and the model's name."""
    m = cfg.model
    _require_choice("model.dtype", m.dtype, _DTYPE_NAMES)
    _require_choice("model.packed_attention", m.packed_attention, ("torch", "fa4"),
                    " ('torch': torch's built-in FlashAttention-2; 'fa4': FlashAttention-4, pip install flash-attn-4)")
    _require(isinstance(m.lora_r, int) and m.lora_r >= 0, "model.lora_r", m.lora_r,
             "use 0 (train every weight) or a positive LoRA rank such as 8 or 16")
    if m.lora_r > 0:
        _require(_finite(m.lora_alpha) and m.lora_alpha > 0, "model.lora_alpha", m.lora_alpha,
                 "use a positive scale such as 32 (the adapters are scaled by lora_alpha / lora_r)")
        _require(_finite(m.lora_dropout) and 0 <= m.lora_dropout < 1, "model.lora_dropout", m.lora_dropout,
                 "use a probability in [0, 1), e.g. 0.0 or 0.05")
        _require(bool(m.lora_target_modules), "model.lora_target_modules", m.lora_target_modules,
                 "name at least one module, e.g. [q_proj, v_proj]")
        # the chunked logprob kernel reads lm_head.weight directly: an adapter there would be neither used nor trained
        _require("lm_head" not in m.lora_target_modules, "model.lora_target_modules", m.lora_target_modules,
                 "leave lm_head out: cohort's logprob kernel reads lm_head.weight directly, so an adapter on it "
                 "would never be used nor trained (all-linear already skips it)")
    _require(isinstance(m.name_or_path, str) and m.name_or_path.strip() != "", "model.name_or_path",
             m.name_or_path, "give a local model folder, a .gguf file, a hub id or smollm2-135m-instruct")


def _check_quantization(cfg: CohortConfig) -> None:
    """model.quantization (QLoRA) against the settings it cannot run with; the machine (CUDA, bitsandbytes) is
    checked by cohort.config.preflight.check_quantization_support."""
    m, q = cfg.model, cfg.model.quantization
    _require_choice("model.quantization", q, ("none", "nf4", "fp4"),
                    " (none: weights in model.dtype; nf4 / fp4: a 4-bit base through bitsandbytes, QLoRA)")
    _require_choice("generation.quantized_engine", cfg.generation.quantized_engine, ("merged_bf16", "4bit"))
    _require_choice("generation.lora_engine", cfg.generation.lora_engine, ("adapters", "merged"))
    if cfg.generation.lora_engine == "merged":
        _require(isinstance(m.lora_r, int) and m.lora_r > 0, "generation.lora_engine", "merged",
                 "it merges LoRA adapters into the engine's copy, and model.lora_r=0 trains none: set model.lora_r, "
                 "or generation.lora_engine=adapters")
        _require(q == "none", "generation.lora_engine", "merged",
                 f"with a 4-bit base (model.quantization={q!r}) generation.quantized_engine decides what the engine "
                 "samples from (merged_bf16 is already a merged copy): remove generation.lora_engine")
        _require(cfg.generation.engine != "hf" and cfg.generation.placement != "server", "generation.lora_engine",
                 "merged", "the merged copy is cohort's in-process engine's (generation.engine=hf and a served engine "
                 "sample otherwise): set generation.engine=auto or cohort and generation.placement=colocate, or "
                 "remove generation.lora_engine")
        _require(cfg.train.sharding != "fsdp", "generation.lora_engine", "merged",
                 "with train.sharding=fsdp the engine samples from its own gathered copy of the weights: remove "
                 "generation.lora_engine")
    if q == "none":
        return
    _require(isinstance(m.lora_r, int) and m.lora_r > 0, "model.quantization", q,
             "a 4-bit base cannot be trained itself, only LoRA adapters on it: set model.lora_r (e.g. 16), or "
             "model.quantization=none")
    _require(cfg.train.device != "cpu", "model.quantization", q,
             "4-bit bitsandbytes weights need a CUDA GPU and train.device='cpu'; use train.device=auto or cuda, or "
             "model.quantization=none")
    _require(cfg.train.sharding != "fsdp", "model.quantization", q,
             "train.sharding=fsdp cannot shard 4-bit bitsandbytes weights in cohort; use train.sharding=none (each "
             "rank holds the small 4-bit base), or model.quantization=none")
    _require(cfg.generation.placement != "server", "model.quantization", q,
             "generation.placement=server pushes merged weights of a model.dtype base, not a 4-bit one; use "
             "generation.placement=colocate, or model.quantization=none")


def _check_data(cfg: CohortConfig) -> None:
    """data: prompt length and truncation, the held-out size, the prompt column, options and few-shot messages."""
    d = cfg.data
    _require(isinstance(d.max_prompt_length, int) and d.max_prompt_length >= 1, "data.max_prompt_length",
             d.max_prompt_length, "use a positive token count, e.g. 512")
    _require_choice("data.truncation", d.truncation, ("left", "drop"),
                    " ('left' keeps the end of a long prompt, 'drop' skips the row)")
    _require(isinstance(d.eval_size, int) and d.eval_size >= 0, "data.eval_size", d.eval_size,
             "use 0 (no held-out split) or a positive number of prompts")
    _require(isinstance(d.prompt_column, str) and d.prompt_column != "", "data.prompt_column", d.prompt_column,
             "name the column that holds the prompt, e.g. prompt or question")
    for name, value in (("data.options", d.options), ("data.eval_options", d.eval_options)):
        _require(isinstance(value, dict), name, value, "give a mapping of option: value (e.g. {size: 500})")
    _require(isinstance(d.few_shot, list) and all(_is_message(m) for m in d.few_shot), "data.few_shot",
             d.few_shot, "give a list of chat messages, each {role: system|user|assistant|tool, content: text} "
             "(an assistant turn may add tool_calls: [{name: ..., arguments: {...}}])")


def _check_generation(cfg: CohortConfig) -> None:
    """generation: the sampling knobs, the KV cache share, the engine, placement and the context limit."""
    g = cfg.generation
    _require(_finite(g.temperature), "generation.temperature", g.temperature, "use 0 (greedy) or a positive number")
    _require(isinstance(g.top_k, int) and g.top_k >= 0, "generation.top_k", g.top_k,
             "use 0 (off) or a positive number of most likely tokens to sample from")
    _require(_finite(g.min_p) and 0 <= g.min_p <= 1, "generation.min_p", g.min_p,
             "use a value in [0, 1] (0: off; e.g. 0.05 keeps tokens at least 5% as likely as the best one)")
    _require(_finite(g.repetition_penalty) and g.repetition_penalty > 0, "generation.repetition_penalty",
             g.repetition_penalty, "use a positive number (1.0: off; > 1 discourages repeats)")
    _require(_finite(g.kv_cache_fraction) and 0 < g.kv_cache_fraction <= 1, "generation.kv_cache_fraction",
             g.kv_cache_fraction, "use a share of free memory in (0, 1], e.g. 0.3")
    _require(g.generation_batch_size is None or (isinstance(g.generation_batch_size, int)
                                                 and g.generation_batch_size >= 1),
             "generation.generation_batch_size", g.generation_batch_size,
             "use a positive number of prompts per generate call, or leave it unset (null)")
    _require(isinstance(g.stop_strings, list) and all(isinstance(s, str) and s for s in g.stop_strings),
             "generation.stop_strings", g.stop_strings, "give a list of non-empty strings, e.g. ['</answer>']")
    _require_choice("generation.engine", g.engine, ("auto", "cohort", "hf"))
    check_hf_generate_kwargs(g.hf_generate_kwargs, g.engine, g.placement)
    _check_placement(cfg)
    longest = max(g.max_completion_length, cfg.run.eval_max_completion_length or 0)
    if g.max_model_len is not None:
        _require(isinstance(g.max_model_len, int) and g.max_model_len > longest, "generation.max_model_len",
                 g.max_model_len, f"it must exceed the longest completion ({longest} tokens: "
                 "generation.max_completion_length / run.eval_max_completion_length) so a prompt fits beside "
                 "it; raise it (at most the model's context) or lower the completion length")


def _check_reward(cfg: CohortConfig) -> None:
    """reward: at least one function, finite weights (not all zero), the timeout and on_error."""
    r = cfg.reward
    # environments may bring every reward themselves (get_reward); setup fails when neither gives one
    _require(isinstance(r.funcs, list) and (len(r.funcs) >= 1 or cfg.agent.environment_factory is not None),
             "reward.funcs", r.funcs, "give at least one reward function, e.g. [accuracy]")
    if r.reward_weights is not None:
        # negative weights are allowed, as in TRL: a weight of -1 turns a score into a penalty
        _require(all(_finite(w) for w in r.reward_weights), "reward.reward_weights", r.reward_weights,
                 "use finite numbers (negative weights make penalties)")
        _require(any(w != 0 for w in r.reward_weights), "reward.reward_weights", r.reward_weights,
                 "at least one weight must be non-zero, or every reward is 0")
    _require(r.timeout_s is None or (_finite(r.timeout_s) and r.timeout_s > 0), "reward.timeout_s", r.timeout_s,
             "use a positive number of seconds, or leave it unset (null) for no limit")
    _require_choice("reward.on_error", r.on_error, ("raise", "skip"))


def _check_advantage(cfg: CohortConfig) -> None:
    """advantage (TRL's booleans are accepted for scale_rewards: true = group, false = none)."""
    a = cfg.advantage
    if not isinstance(a.scale_rewards, bool):
        _require_choice("advantage.scale_rewards", a.scale_rewards, _SCALE_REWARDS,
                        " (group: divide by each group's std; batch: by the batch's; none: Dr. GRPO)")
    if is_import_path(a.estimator):  # user code ("pkg.module:Class"): built once here, so a bad path fails now
        try:
            estimator = build_advantage_estimator(a.estimator)
        except (ConfigError, TypeError) as exc:
            raise ConfigError(f"advantage.estimator={a.estimator!r} is not valid: {exc}") from None
    else:
        _require_choice("advantage.estimator", a.estimator, tuple(ESTIMATORS),
                        " (grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg; docs/algorithms.md; or an "
                        "import path 'pkg.module:Class')")
        estimator = build_advantage_estimator(a.estimator)
    _require_choice("advantage.multi_objective_aggregation", a.multi_objective_aggregation, _AGGREGATIONS)
    why = estimator.no_normalize_then_sum
    _require(why is None or a.multi_objective_aggregation != "normalize_then_sum",
             "advantage.multi_objective_aggregation", a.multi_objective_aggregation,
             f"advantage.estimator={a.estimator} needs 'sum_then_normalize' ({why})")


def _check_router_aux_loss(cfg: CohortConfig) -> None:
    """loss.router_aux_loss_coef: null (the model's own coefficient), 0.0 (off) or a finite positive weight."""
    coef = cfg.loss.router_aux_loss_coef
    _require(coef is None or (_finite(coef) and coef >= 0), "loss.router_aux_loss_coef", coef,
             "use null (the model config's own coefficient), 0.0 (off) or a finite positive weight, e.g. 0.001")


def _check_router_replay(cfg: CohortConfig) -> None:
    """train.router_replay: needs an engine that records each token's experts, cohort's own in this process (the
    policy's side, a mixture-of-experts model the engine runs, is checked at set-up: cohort.setup.settings)."""
    t, g = cfg.train, cfg.generation
    _require(isinstance(t.router_replay, bool), "train.router_replay", t.router_replay, "use true or false")
    if not t.router_replay:
        return
    _require(g.placement != "server", "train.router_replay", t.router_replay,
             "generation.placement=server samples in a `cohort serve` process, which does not send back the experts "
             "it routed each token to; use generation.placement=colocate, or train.router_replay=false")
    _require(g.engine != "hf", "train.router_replay", t.router_replay,
             "generation.engine=hf (Hugging Face generate) records no routing; use generation.engine=auto or cohort "
             "(cohort's engine records it), or train.router_replay=false")


def _check_train(cfg: CohortConfig) -> None:
    """train: the optimiser's settings, warmup, seed, scheduler kwargs and the device."""
    t = cfg.train
    _require(_finite(t.learning_rate) and t.learning_rate > 0, "train.learning_rate", t.learning_rate,
             "use a positive learning rate, e.g. 1e-6")
    _require(_finite(t.weight_decay) and t.weight_decay >= 0, "train.weight_decay", t.weight_decay,
             "use 0 or a positive decay, e.g. 0.01")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(t, name)
        _require(_finite(value) and 0 <= value < 1, f"train.{name}", value, "use a value in [0, 1), e.g. 0.9")
    eps = getattr(t, "adam_epsilon", 1e-8)
    _require(_finite(eps) and eps > 0, "train.adam_epsilon", eps, "use a small positive number, e.g. 1e-8")
    _require(_finite(t.max_grad_norm) and t.max_grad_norm > 0, "train.max_grad_norm", t.max_grad_norm,
             "use a positive clipping norm, e.g. 1.0")
    _require(_finite(t.warmup_steps) and t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps,
             "use 0, a number of optimiser updates, or a fraction in (0, 1) of them")
    _require(isinstance(t.seed, int) and not isinstance(t.seed, bool) and t.seed >= 0, "train.seed", t.seed,
             "use a non-negative integer")
    _require(isinstance(t.lr_scheduler_kwargs, dict), "train.lr_scheduler_kwargs", t.lr_scheduler_kwargs,
             "give a mapping, e.g. {min_lr_rate: 0.1}")
    _require(_device_ok(t.device), "train.device", t.device, "use auto, cpu, cuda or cuda:<index>")


def _check_run(cfg: CohortConfig) -> None:
    """run: the output directory, resume vs overwrite, logging, checkpoints, evaluation and report_to."""
    run = cfg.run
    _require(isinstance(run.output_dir, str) and run.output_dir.strip() != "", "run.output_dir", run.output_dir,
             "give a folder for the run, e.g. runs/my-run")
    _require(not (run.resume not in (False, None, "") and run.overwrite), "run.overwrite", run.overwrite,
             f"run.resume={run.resume!r} continues the run that overwrite would delete; choose one")
    _require(isinstance(run.logging_steps, int) and run.logging_steps >= 1, "run.logging_steps", run.logging_steps,
             "use 1 (every step) or more")
    _require(isinstance(run.save_steps, int) and run.save_steps >= 0, "run.save_steps", run.save_steps,
             "use 0 (save only at the end) or a positive number of steps")
    _require(run.save_total_limit is None or (isinstance(run.save_total_limit, int) and run.save_total_limit >= 1),
             "run.save_total_limit", run.save_total_limit,
             "keep at least 1 checkpoint, or leave it unset (null) to keep every one")
    _require(isinstance(run.eval_steps, int) and run.eval_steps >= 0, "run.eval_steps", run.eval_steps,
             "use 0 (evaluate before and after training only) or a positive number of steps")
    _require(isinstance(run.eval_num_samples, int) and run.eval_num_samples >= 1, "run.eval_num_samples",
             run.eval_num_samples, "use 1 (greedy) or more completions per eval prompt")
    _require(run.eval_max_prompts is None or (isinstance(run.eval_max_prompts, int) and run.eval_max_prompts >= 1),
             "run.eval_max_prompts", run.eval_max_prompts, "use a positive number, or leave it unset (null)")
    try:
        resolve_report_to(run.report_to)
    except ConfigError as exc:
        raise ConfigError(f"run.report_to={run.report_to!r} is not valid: {exc}.") from None


def _check_placement(cfg: CohortConfig) -> None:
    """generation.placement / server_address / server timeouts and train.max_staleness (docs/serving.md)."""
    g, t = cfg.generation, cfg.train
    _require_choice("generation.placement", g.placement, ("colocate", "server"),
                    " (colocate: an engine in each trainer process; server: a `cohort serve` process)")
    for name in ("server_timeout_s", "server_connect_timeout_s", "server_liveness_timeout_s"):
        value = getattr(g, name)
        _require(_finite(value) and value > 0, f"generation.{name}", value, "use a positive number of seconds")
    _require(isinstance(t.max_staleness, int) and not isinstance(t.max_staleness, bool) and t.max_staleness >= 0,
             "train.max_staleness", t.max_staleness,
             "use 0 (on-policy, synchronous) or a positive number of policy versions a completion may lag")
    if g.placement == "server":
        _require(g.server_address is not None, "generation.server_address", g.server_address,
                 "generation.placement=server needs the server's host:port, e.g. 127.0.0.1:8000 (what `cohort "
                 "serve MODEL --port 8000` prints)")
        parse_address(str(g.server_address))
        if t.max_staleness > 0:
            correction = cfg.loss.params.get("sampler_is_correction", True)
            _require(correction is not False, "loss.sampler_is_correction", correction,
                     f"train.max_staleness={t.max_staleness} samples with older weights; the sampler importance "
                     "weights are what correct for it, keep loss.sampler_is_correction=true")
    elif t.max_staleness > 0 and t.async_rollouts is not True:
        _require(False, "train.max_staleness", t.max_staleness,
                 "generation overlaps training only when it runs elsewhere (generation.placement=server with "
                 "generation.server_address; start the server with `cohort serve MODEL`) or with "
                 "train.async_rollouts=true on the colocated engine; or use 0")


def _device_ok(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    if name == "auto":
        return True
    try:
        torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        return False
    return True

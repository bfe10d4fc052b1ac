"""Checking a whole config before any work, in a fixed order (the first failing rule is the error a user sees).

1. the batch schedule and the rules that span sections (here), including that the loss and its parameters
   build (cohort.algorithms);
2. every field's range and enum (cohort.config.checks.validate_fields);
3. the inputs those fields name: data options against the source, reward names and kwargs, tool import paths
   (cohort.config.preflight.check_inputs).

Each error names the field, the value and the fix. `CohortConfig.validate` is the entry point.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from cohort import distributed
from cohort.algorithms import build_policy_loss
from cohort.config.async_checks import check_async_rollouts
from cohort.config.checks import _require, _require_choice, _scheduler_names, validate_fields
from cohort.config.preflight import check_inputs
from cohort.errors import ConfigError

if TYPE_CHECKING:
    from cohort.config.tree import CohortConfig


def validate_config(cfg: CohortConfig) -> None:
    """Every rule, in the order above; the first that fails raises a ConfigError naming field, value and fix."""
    _check_batch_schedule(cfg)
    _check_time_limits(cfg)
    _check_lengths_and_sampling(cfg)
    _check_resampling(cfg)
    _check_optimizer_layout(cfg)
    _check_choices(cfg)
    _check_loss(cfg)
    _check_agent(cfg)
    _check_reward_weights(cfg)
    validate_fields(cfg)
    check_async_rollouts(cfg)
    check_inputs(cfg)  # data options against the source, reward names and kwargs, tool import paths


def _check_batch_schedule(cfg: CohortConfig) -> None:
    """Group size, prompts per step, mini-batches (whole groups per update), iterations and steps."""
    g, t = cfg.generation, cfg.train
    _require(g.num_generations >= 2, "generation.num_generations", g.num_generations,
             "GRPO normalises rewards within a group of completions of the same prompt; use 2 or more")
    _require(t.prompts_per_step >= 1, "train.prompts_per_step", t.prompts_per_step, "use 1 or more")
    _require(t.mini_batches >= 1 and t.prompts_per_step % t.mini_batches == 0, "train.mini_batches",
             t.mini_batches, f"it must divide train.prompts_per_step={t.prompts_per_step} so every "
             "optimiser update sees whole groups; choose a divisor")
    _require(t.num_iterations >= 1, "train.num_iterations", t.num_iterations, "use 1 or more")
    _require(t.max_steps >= 1, "train.max_steps", t.max_steps, "use 1 or more")


def _check_time_limits(cfg: CohortConfig) -> None:
    """train.max_train_time_s, run.time_limit_s and the collectives' train.dist_timeout_s."""
    t = cfg.train
    _require(t.max_train_time_s is None or t.max_train_time_s > 0, "train.max_train_time_s",
             t.max_train_time_s, "use a positive number of seconds, or leave it unset (null) for no limit")
    _require(cfg.run.time_limit_s is None or cfg.run.time_limit_s > 0, "run.time_limit_s",
             cfg.run.time_limit_s, "use a positive number of seconds, or leave it unset (null) for no limit")
    _require(t.dist_timeout_s > 0, "train.dist_timeout_s", t.dist_timeout_s,
             "use a positive number of seconds (default 600), longer than rank 0's evaluation or save")


def _check_lengths_and_sampling(cfg: CohortConfig) -> None:
    """Completion caps (training and held-out), temperature, top_p and the micro-batch token budget."""
    g = cfg.generation
    _require(g.max_completion_length >= 1, "generation.max_completion_length", g.max_completion_length,
             "use 1 or more")
    _require(cfg.run.eval_max_completion_length is None or cfg.run.eval_max_completion_length >= 1,
             "run.eval_max_completion_length", cfg.run.eval_max_completion_length,
             "use 1 or more, or leave it unset to use generation.max_completion_length")
    _require(g.temperature >= 0, "generation.temperature", g.temperature, "use 0 (greedy) or more")
    _require(0 < g.top_p <= 1, "generation.top_p", g.top_p, "use a value in (0, 1]")
    _require(cfg.train.token_budget >= 1, "train.token_budget", cfg.train.token_budget, "use a positive token count")


def _check_resampling(cfg: CohortConfig) -> None:
    """Dynamic sampling's bounds: reward.max_oversample and reward.max_resample_tries."""
    _require(cfg.reward.max_oversample >= 1, "reward.max_oversample", cfg.reward.max_oversample,
             "use 1 (draw only the missing prompts) or more")
    _require(cfg.reward.max_resample_tries >= 1, "reward.max_resample_tries", cfg.reward.max_resample_tries,
             "use 1 or more")


def _check_optimizer_layout(cfg: CohortConfig) -> None:
    """Where optimiser state lives: offload vs master weights vs FSDP sharding, and the logprob chunk size."""
    t = cfg.train
    _require(not (t.optimizer_offload and t.master_weights), "train.optimizer_offload", t.optimizer_offload,
             "offloaded Adam moments are kept in the weights' dtype; set train.master_weights=false with it")
    _require_choice("train.sharding", t.sharding, ("none", "fsdp"),
                    " ('none': data parallel, a whole model per rank; 'fsdp': FSDP2 sharding)")
    _require(not (t.sharding == "fsdp" and t.optimizer_offload), "train.optimizer_offload", t.optimizer_offload,
             "with train.sharding=fsdp the Adam state is already split over the ranks; set it to false")
    _require(t.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", t.logprob_chunk_tokens,
             "use a positive token count (e.g. 1024; smaller saves memory, larger launches fewer kernels)")
    _check_context_parallel(cfg)


def _check_context_parallel(cfg: CohortConfig) -> None:
    """train.context_parallel: a whole number dividing the ranks, a token budget of whole zig-zag chunks, and the
    settings context parallelism does not support refused by name."""
    t, cp = cfg.train, cfg.train.context_parallel
    _require(isinstance(cp, int) and not isinstance(cp, bool) and cp >= 1, "train.context_parallel", cp,
             "use a whole number of ranks per context-parallel group, 1 (off) or more")
    if cp == 1:
        return
    info = distributed.current()
    world = info.world_size if info.enabled else distributed.world_size_from_env()
    _require(world % cp == 0, "train.context_parallel", cp,
             f"it must divide the number of ranks ({world}); launch a multiple of {cp} ranks (torchrun "
             f"--nproc-per-node {cp} -m cohort.cli train ...)"
             + (f" or choose a divisor of {world}" if world > 1 else " or set train.context_parallel=1"))
    _require(t.token_budget % (2 * cp) == 0, "train.token_budget", t.token_budget,
             f"with train.context_parallel={cp} a packed row is cut into {2 * cp} equal chunks; use a multiple of "
             f"{2 * cp} (e.g. {max(2 * cp, t.token_budget // (2 * cp) * (2 * cp))})")
    attn = cfg.model.attn_implementation
    unsupported = [  # (field, value, whether it is on, the fix)
        ("train.share_prompts", t.share_prompts, t.share_prompts,
         "set train.share_prompts=false (each completion keeps its own copy of its prompt)"),
        ("model.compile_layers", cfg.model.compile_layers, cfg.model.compile_layers, "set model.compile_layers=false"),
        ("model.attn_implementation", attn, str(attn or "").startswith("flash_attention"),
         "set model.attn_implementation=sdpa (cohort's packed attention runs the flash kernels itself)"),
        ("loss.router_aux_loss_coef", cfg.loss.router_aux_loss_coef, bool(cfg.loss.router_aux_loss_coef),
         "set loss.router_aux_loss_coef=0.0"),
        ("train.router_replay", t.router_replay, t.router_replay, "set train.router_replay=false"),
    ]
    for name, value, on, fix in unsupported:
        if on:
            raise ConfigError(f"{name}={value!r} is not supported with train.context_parallel={cp}: {fix}, or set "
                              "train.context_parallel=1.")


def _check_choices(cfg: CohortConfig) -> None:
    """The enums checked first: data.truncation, generation.engine, reward.on_error, train.lr_scheduler_type."""
    t = cfg.train
    _require_choice("data.truncation", cfg.data.truncation, ("left", "drop"))
    _require_choice("generation.engine", cfg.generation.engine, ("auto", "cohort", "hf"))
    _require_choice("reward.on_error", cfg.reward.on_error, ("raise", "skip"))
    _require_choice("agent.malformed_tool_calls", cfg.agent.malformed_tool_calls, ("feedback", "end"))
    close = difflib.get_close_matches(str(t.lr_scheduler_type), _scheduler_names(), n=1, cutoff=0.6)
    _require(t.lr_scheduler_type.removeprefix("hf:") in _scheduler_names(), "train.lr_scheduler_type",
             t.lr_scheduler_type, (f"did you mean '{close[0]}'? " if close else "")
             + "use 'constant' or 'cosine' (cohort's) or one of transformers' "
             f"{', '.join(n for n in _scheduler_names() if n not in ('constant', 'cosine'))}")


def _check_loss(cfg: CohortConfig) -> None:
    """The loss builds from its name and parameters; train.max_nonfinite_updates bounds skipped updates."""
    try:  # unknown loss names and parameters fail here, before any work
        build_policy_loss(cfg.loss.loss_type, cfg.loss.loss_params())
    except ConfigError:
        raise
    except (ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"loss (loss.loss_type={cfg.loss.loss_type!r}): {exc} Set it as loss.<name>=value."
                          ) from exc
    t = cfg.train
    _require(isinstance(t.max_nonfinite_updates, int) and t.max_nonfinite_updates >= 1,
             "train.max_nonfinite_updates", t.max_nonfinite_updates,
             "use 1 or more: how many optimiser updates in a row may be skipped for a non-finite loss or "
             "gradient norm before the run stops")


def _check_agent(cfg: CohortConfig) -> None:
    """Tool calling: rounds of tool calls, the tool timeout, inline_tools and the environment factory."""
    g = cfg.generation
    _require(g.max_tool_calling_iterations is None or g.max_tool_calling_iterations >= 0,
             "generation.max_tool_calling_iterations", g.max_tool_calling_iterations,
             "use 0 or more rounds of tool calls, or leave it unset (null) for no cap")
    _require(cfg.agent.tool_timeout_s > 0, "agent.tool_timeout_s", cfg.agent.tool_timeout_s,
             "use a positive number of seconds")
    inline = cfg.agent.inline_tools
    _require(isinstance(inline, bool) or inline == "auto", "agent.inline_tools", inline,
             "use true (tools run on the engine's thread), false (on a thread pool) or auto (on the engine's "
             "thread while each call takes under 2 ms)")
    factory = cfg.agent.environment_factory
    _require(factory is None or isinstance(factory, str) or callable(factory)
             or (isinstance(factory, dict) and bool(factory) and all(isinstance(v, str) or callable(v)
                                                                for v in factory.values())),
             "agent.environment_factory", factory,
             "give 'pkg.module:Class', or a mapping {name: 'pkg.module:Class'} routed by the 'environment' column")


def _check_reward_weights(cfg: CohortConfig) -> None:
    """reward.reward_weights: one per reward function."""
    weights = cfg.reward.reward_weights
    _require(weights is None or len(weights) == len(cfg.reward.funcs), "reward.reward_weights", weights,
             f"give one weight per reward function ({len(cfg.reward.funcs)})")

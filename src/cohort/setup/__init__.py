"""Turn a `CohortConfig` into the live objects of a run, failing early on any bad input.

Order matters: config checks, then the model (a missing path fails here), then data (a missing prompt
column fails here), then rewards and the loss (unknown names fail here). Only after all of that does the
trainer create the run directory, so a bad input never leaves a half-written run behind.

This module is the assembly (`Components`, `build_components`, called by the trainer, the TRL facade and
the CLI); the parts live beside it, one role each:

- `policy`: device and dtype, the policy loaded or handed in, LoRA, the reference copy, FSDP sharding;
- `lengths`: the context, the prompt cap beside the completion, the length the engine is sized for;
- `data`: the training and held-out prompts, encoded within that cap;
- `rewards`: reward functions, agent environments, the tool-calling turn loop;
- `engine`: which rollout engine samples and how it is built, EOS ids, sampling parameters;
- `memory_plan`: the memory estimate and the engine's KV-cache share.

Their public names stay importable from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cohort import distributed
from cohort.algorithms import build_policy_loss
from cohort.config import CohortConfig
from cohort.forward.invariant.parity import set_logprob_parity
from cohort.policy.optim import build_optimizer, build_scheduler
from cohort.run.seeding import seed_everything, set_deterministic
from cohort.setup.data import fit_to_context, load_run_data
from cohort.setup.engine import build_engine, build_run_engine, sampling_params_for
from cohort.setup.length_checks import check_lengths
from cohort.setup.lengths import (
    engine_model_len,
    longest_completion,
    longest_prompt,
    model_context,
    prompt_token_limit,
)
from cohort.setup.memory_plan import engine_memory, plan_memory
from cohort.setup.policy import (
    compile_layers,
    frozen_copy,
    prepare_policy,
    resolve_device,
    resolve_dtype,
    shard_for_fsdp,
)
from cohort.setup.rewards import (
    build_environments,
    build_reward_runner,
    build_turn_loop,
    with_environment_rewards,
)
from cohort.setup.settings import check_engine_abilities, update_settings
from cohort.types import EngineAbilities, RolloutEngine, SamplingParams
from cohort.update import UpdateSettings

__all__ = [
    "Components", "build_components", "build_engine", "engine_model_len", "frozen_copy", "longest_completion",
    "model_context", "prompt_token_limit", "resolve_device", "resolve_dtype", "sampling_params_for",
]


@dataclass(frozen=True)
class Components:
    """The built objects of a run, fixed once set-up ends (`dataclasses.replace` makes a changed copy). What
    changes as training goes on is the run's `cohort.run.state.RunState`, the checkpoint's trainer state."""

    policy: torch.nn.Module
    tokenizer: Any
    reference: torch.nn.Module | None
    loss_fn: Any
    engine: RolloutEngine
    train_data: Any
    eval_data: Any | None
    reward_runner: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampling_params: SamplingParams
    advantage_kwargs: dict[str, Any]
    device: torch.device
    update_settings: UpdateSettings  # the update's one settings record (cohort.setup.settings)
    abilities: EngineAbilities  # what the engine can do besides generate (checked once)
    turn_loop: Any = None  # agent.tools: multi-turn tool-calling rollouts (cohort.agents.rollout_loop.TurnLoop)
    processor: Any = None  # a vision-language model's processor (saved with checkpoints); None for text models
    memory_estimate: Any = None  # cohort.policy.memory.MemoryEstimate printed at start (None: architecture not readable)


def _optimization(cfg: CohortConfig, policy):
    """The optimizer and the learning-rate schedule over every update of the run."""
    t = cfg.train
    optimizer = build_optimizer(policy, lr=t.learning_rate, weight_decay=t.weight_decay,
                                betas=(t.adam_beta1, t.adam_beta2), master_weights=t.master_weights,
                                offload=t.optimizer_offload, eps=t.adam_epsilon)
    total_updates = t.max_steps * t.mini_batches * t.num_iterations
    scheduler = build_scheduler(optimizer, kind=t.lr_scheduler_type, warmup_steps=t.warmup_steps,
                                total_steps=total_updates, kwargs=t.lr_scheduler_kwargs)
    return optimizer, scheduler


def build_components(cfg: CohortConfig, *, policy=None, tokenizer=None, reward_runner=None,
                     train_data=None, eval_data=None, environments=None, echo=print) -> Components:
    cfg.validate()
    # train.seed decides what setup draws too (LoRA's initial A matrices), as TRL seeds before get_peft_model;
    # train() seeds again, so the training stream itself does not depend on what setup drew
    seed_everything(cfg.train.seed)
    set_deterministic(cfg.train.deterministic)  # before the model loads: cuBLAS reads its workspace setting once
    if environments is None:  # (the TRL facade hands in the ones it probed at construction, as TRL keeps them)
        environments = build_environments(cfg)  # before the model: a bad environment fails fast
    device = resolve_device(distributed.local_device(cfg.train.device))
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_lengths(cfg, policy, device, dtype)  # the completion against the context and the memory, before the load
    policy, tokenizer, processor = prepare_policy(cfg, policy, tokenizer, device=device, dtype=dtype, echo=echo)
    set_logprob_parity(policy, cfg.generation.logprob_parity)  # the model checked and marked before the engine
    loss_fn = build_policy_loss(cfg.loss.loss_type, cfg.loss.loss_params())
    reward_runner = with_environment_rewards(reward_runner or build_reward_runner(cfg), environments)
    turn_loop = build_turn_loop(cfg, tokenizer, environments, processor)
    if train_data is None:
        train_data, eval_data = load_run_data(cfg, tokenizer, echo, tools=turn_loop.tools if turn_loop else None,
                                              policy=policy, processor=processor)
    else:  # handed-in data (facade, tests): prompts that cannot fit beside the completion are cut here too
        train_data, eval_data = fit_to_context(cfg, policy, train_data, eval_data, echo)
    reference = None
    if float(getattr(loss_fn, "beta", 0.0) or 0.0) != 0.0:
        reference = frozen_copy(policy)
    compute_dtype = next(policy.parameters()).dtype
    sharded = shard_for_fsdp(cfg, policy, reference, device) if cfg.train.sharding == "fsdp" else None
    compile_layers(cfg, policy, reference, device, sharded=sharded is not None)
    optimizer, scheduler = _optimization(cfg, policy)
    longest = longest_prompt(train_data, eval_data)
    kv_fraction, memory_estimate = plan_memory(cfg, policy, device, reference is not None, echo, dtype=compute_dtype,
                                                 longest_prompt=longest_prompt(train_data))  # trained on
    engine = build_run_engine(cfg, policy, tokenizer, device, echo, kv_fraction, longest, sharded)
    if memory_estimate is not None:  # the engine's pool and weight copies as built, then the whole table
        memory_estimate.kv_cache, copies = engine_memory(engine)
        memory_estimate.engine_weights += copies
        echo(memory_estimate.table() + (f"\n  (per rank: FSDP over {distributed.current().world_size} rank(s))"
                                        if sharded is not None else ""))
    a = cfg.advantage
    return Components(
        policy=policy, tokenizer=tokenizer, reference=reference, loss_fn=loss_fn,
        engine=engine, train_data=train_data,
        eval_data=eval_data,
        reward_runner=reward_runner, optimizer=optimizer, scheduler=scheduler,
        sampling_params=sampling_params_for(cfg, tokenizer, n=cfg.generation.num_generations, seed=None),
        advantage_kwargs={"scale_rewards": a.scale_rewards, "estimator": a.estimator,
                          "reward_weights": (reward_runner.weights.tolist() if environments is not None
                                             and environments.reward_classes else cfg.reward.reward_weights),
                          "multi_objective_aggregation": a.multi_objective_aggregation},
        device=device, update_settings=update_settings(cfg, policy), abilities=check_engine_abilities(cfg, engine, echo),
        turn_loop=turn_loop, processor=processor, memory_estimate=memory_estimate)

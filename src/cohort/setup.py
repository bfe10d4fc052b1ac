"""Turn a `CohortConfig` into the live objects of a run, failing early on any bad input.

Order matters: config checks, then the model (a missing path fails here), then data (a missing prompt
column fails here), then rewards and the loss (unknown names fail here). Only after all of that does the
trainer create the run directory, so a bad input never leaves a half-written run behind.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from cohort import distributed
from cohort.algorithms import build_policy_loss
from cohort.config import CohortConfig
from cohort.data import drop_overlap, load_prompt_dataset, reasoning_gym_eval_set, train_eval_split
from cohort.errors import ConfigError
from cohort.memory_plan import engine_memory, plan_memory
from cohort.model import load_policy
from cohort.model import resolve_dtype as model_dtype
from cohort.optim import build_optimizer, build_scheduler
from cohort.rewards import RewardRunner, get_reward_function
from cohort.types import RolloutEngine, SamplingParams


@dataclass
class Components:
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
    num_tokens: int = 0
    train_time_s: float = 0.0
    last_samples: list[dict] = field(default_factory=list)
    turn_loop: Any = None  # agent.tools: multi-turn tool-calling rollouts (cohort.agents.rollout_loop.TurnLoop)
    processor: Any = None  # a vision-language model's processor (saved with checkpoints); None for text models
    memory_estimate: Any = None  # cohort.memory.MemoryEstimate printed at start (None: architecture not readable)


def _with_lora(cfg: CohortConfig, policy):
    """model.lora_r > 0: wrap the policy in peft LoRA adapters; the engine runs them unmerged, checkpoints
    save only the adapters."""
    m = cfg.model
    if m.lora_r <= 0:
        return policy
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise ConfigError(f"model.lora_r={m.lora_r} needs peft: pip install peft (or set model.lora_r=0).") from exc
    from cohort.vision.setup import lora_targets

    lora = LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                      target_modules=lora_targets(policy, list(m.lora_target_modules)), task_type="CAUSAL_LM")
    return get_peft_model(policy, lora)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference policy: the starting weights, frozen (beta > 0 only)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu or auto.")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on a GPU (weights read in place by the engine) and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return model_dtype(name)


def sampling_params_for(cfg: CohortConfig, tokenizer, *, n: int, seed: int | None) -> SamplingParams:
    g = cfg.generation
    return SamplingParams(
        n=n, max_tokens=g.max_completion_length, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
        min_p=g.min_p, repetition_penalty=g.repetition_penalty, stop_strings=tuple(g.stop_strings),
        ignore_eos=g.ignore_eos, seed=seed)


def build_engine(cfg: CohortConfig, policy, tokenizer, device: torch.device, echo=print,
                 kv_cache_fraction: float | None = None, longest_prompt: int | None = None) -> RolloutEngine:
    """cohort's own engine whenever the architecture is supported (on the CPU too, where its shared prompt
    prefill makes it about 2x faster than `generate` for SmolLM2); else Hugging Face `generate`."""
    from cohort.engine.hf_backend import HFGenerateEngine
    from cohort.vision.setup import build_engine as vision_engine

    g = cfg.generation
    if g.placement == "server":  # a `cohort serve` process samples; rank 0 pushes the weights after each step
        from cohort.serving import RemoteEngine

        echo(f"generation: on the cohort server at {g.server_address} (generation.placement=server)")
        return RemoteEngine(str(g.server_address), policy, timeout_s=g.server_timeout_s,
                            connect_timeout_s=g.server_connect_timeout_s, pusher=distributed.current().is_main,
                            session=_run_session(), liveness_timeout_s=g.server_liveness_timeout_s)

    # a VLM the paged engine cannot run: the vision group engine (None for text models and supported VLMs)
    vlm = vision_engine(policy, tokenizer, _eos_ids(tokenizer, policy), echo, cfg.generation.engine)
    if vlm is not None:
        return vlm
    choice = cfg.generation.engine
    if choice == "auto":
        choice = "cohort"
    if choice == "cohort":
        from cohort.engine import CohortEngine, engine_supports

        ok, why = engine_supports(policy)
        if ok:
            return CohortEngine(policy, tokenizer, eos_token_ids=_eos_ids(tokenizer, policy),
                                kv_cache_fraction=kv_cache_fraction or cfg.generation.kv_cache_fraction,
                                fuse_projections=cfg.generation.fuse_projections, device=device,
                                max_model_len=engine_model_len(cfg, policy, longest_prompt))
        echo(f"cohort engine does not support this model ({why}); falling back to Hugging Face generate")
    return HFGenerateEngine(policy, tokenizer, eos_token_ids=_eos_ids(tokenizer, policy),
                            batch_size=cfg.generation.generation_batch_size)


def _run_session() -> str:
    """One id for the run, the same on every rank (rank 0's): a server serves the weights its rank 0 pushed."""
    import uuid

    session = [uuid.uuid4().hex]
    if distributed.current().enabled:
        import torch.distributed as dist

        dist.broadcast_object_list(session, src=0)
    return session[0]


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


def _eos_ids(tokenizer, model=None) -> list[int]:
    """The tokenizer's EOS plus the model's generation_config ones (Qwen ends a chat turn on <|im_end|> while
    its tokenizer's EOS is <|endoftext|>: `generate` stops on both, so the engine must too)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    ids.update(extra if isinstance(extra, list | tuple) else [] if extra is None else [extra])
    return sorted(int(i) for i in ids)


def _rewards(cfg: CohortConfig) -> RewardRunner:
    funcs = []
    for spec in cfg.reward.funcs:
        if isinstance(spec, dict):
            if len(spec) != 1:
                raise ConfigError(f"reward.funcs entry {spec!r} must be a name or a one-key mapping "
                                  "{name: {kwargs}}.")
            (name, kwargs), = spec.items()
            funcs.append(get_reward_function(name, **(kwargs or {})))
        else:
            funcs.append(spec if callable(spec) else get_reward_function(spec))
    return RewardRunner(funcs, cfg.reward.reward_weights, timeout_s=cfg.reward.timeout_s,
                        on_error=cfg.reward.on_error)


def _environments(cfg: CohortConfig):
    """agent.environment_factory: the run's `Environments` (one probe instance of each, so an environment without
    `reset` or with a tool method lacking hints/docstring fails here, before any model loads); None without."""
    if cfg.agent.environment_factory is None:
        return None
    from cohort.agents.environments import Environments

    return Environments(cfg.agent.environment_factory, tools=list(cfg.agent.tools))


def _with_environment_rewards(runner: RewardRunner, environments) -> RewardRunner:
    """TRL 1.16: each environment class with get_reward is one more reward function (weight 1, named after the
    class), reading the `environments` column (each rollout's instance); its column reaches the advantages."""
    funcs = environments.reward_functions() if environments is not None else []
    if not funcs:
        return runner
    return RewardRunner(list(runner.funcs) + funcs, runner.weights.tolist() + [1.0] * len(funcs),
                        timeout_s=runner.timeout_s, on_error=runner.on_error)


def _turn_loop(cfg: CohortConfig, tokenizer, environments=None):
    """agent.tools (or agent.environment_factory): the turn loop that runs them between model turns; None
    without tools (single-turn). With environments, every rollout calls its own instance's methods."""
    a = cfg.agent
    if not a.tools and environments is None:
        return None
    from cohort.agents.rollout_loop import TurnLoop
    from cohort.agents.templates import check_renders_tools
    from cohort.data.sources import import_object

    check_renders_tools(tokenizer)  # model.chat_template=chatml_tools gives a model without tool support one
    tools = environments.all_tools if environments is not None else list(a.tools)
    return TurnLoop(tokenizer, tools, max_iterations=cfg.generation.max_tool_calling_iterations,
                    tool_timeout_s=a.tool_timeout_s, parser=import_object(a.tool_parser) if a.tool_parser else None,
                    environments=environments, inline_tools=bool(a.inline_tools))


def _data(cfg: CohortConfig, tokenizer, echo, tools=None, policy=None, processor=None):
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
    from cohort.vision.setup import encode_dataset  # images through the processor; plain encode otherwise

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


def _longest_prompt(*datasets) -> int | None:
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


def _fit_to_context(cfg: CohortConfig, policy, train_data, eval_data, echo):
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


def _shard(cfg: CohortConfig, policy, reference, device: torch.device):
    """train.sharding=fsdp: shard the policy (and the reference) in place; returns (the engine's mirror of the
    policy, the WeightGather that refreshes it after each optimizer step)."""
    from cohort.distributed import fsdp

    ok, why = fsdp.fsdp_available()
    if not ok:
        raise ConfigError(f"train.sharding=fsdp: {why}.")
    mirror = fsdp.mirror_for_engine(policy)  # keeps the loaded bf16 storage: no extra memory
    units = fsdp.shard_model(policy, device=device, master_weights=cfg.train.master_weights,
                             reshard_after_forward=cfg.train.fsdp_reshard_after_forward)
    if reference is not None:
        fsdp.shard_model(reference, device=device, master_weights=False, trainable=False)
    return mirror, fsdp.WeightGather(policy, mirror, units)


def build_components(cfg: CohortConfig, *, policy=None, tokenizer=None, reward_runner=None,
                     train_data=None, eval_data=None, echo=print) -> Components:
    cfg.validate()
    environments = _environments(cfg)  # before the model: a bad environment fails fast
    device = resolve_device(distributed.local_device(cfg.train.device))
    dtype = resolve_dtype(cfg.model.dtype, device)
    from cohort.vision import setup as vision

    tokenizer, processor = vision.split_processor(tokenizer)  # a VLM's processor handed in (facade, tests)
    if policy is None:
        loaded = vision.load_model(cfg, dtype=dtype, device=device)  # None unless a vision-language model
        policy, tokenizer, processor = loaded or (*load_policy(
            cfg.model.name_or_path, dtype=dtype, device=device, gguf_file=cfg.model.gguf_file,
            trust_remote_code=cfg.model.trust_remote_code, attn_implementation=cfg.model.attn_implementation), None)
    elif next(policy.parameters()).device != device:
        policy.to(device)  # a model object handed in (facade, tests) trains where the config says
    vision.check_settings(cfg, policy)
    vision.prepare_policy(cfg, policy, echo)
    policy = _with_lora(cfg, policy)
    if cfg.model.chat_template and tokenizer is not None:  # before any prompt is rendered
        from cohort.agents.templates import apply_chat_template_override

        apply_chat_template_override(tokenizer, cfg.model.chat_template)
    if cfg.model.gradient_checkpointing:
        # transformers >= 5.2x renamed it (the old name warns); older releases have only the old one
        enable = getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable
        enable()
    loss_fn = build_policy_loss(cfg.loss.loss_type, cfg.loss.loss_params())
    reward_runner = _with_environment_rewards(reward_runner or _rewards(cfg), environments)
    turn_loop = _turn_loop(cfg, tokenizer, environments)
    if train_data is None:
        train_data, eval_data = _data(cfg, tokenizer, echo, tools=turn_loop.tools if turn_loop else None,
                                      policy=policy, processor=processor)
    else:  # handed-in data (facade, tests): prompts that cannot fit beside the completion are cut here too
        train_data, eval_data = _fit_to_context(cfg, policy, train_data, eval_data, echo)
    reference = None
    if float(getattr(loss_fn, "beta", 0.0) or 0.0) != 0.0:
        reference = frozen_copy(policy)
    compute_dtype = next(policy.parameters()).dtype
    sharded = _shard(cfg, policy, reference, device) if cfg.train.sharding == "fsdp" else None
    if cfg.model.compile_layers and device.type == "cuda":
        from cohort.packing import compile_decoder_layers

        compile_decoder_layers(policy, forward_only=sharded is not None)  # bench/grpo_step.py's fast row
        if reference is not None:
            compile_decoder_layers(reference, forward_only=sharded is not None)
    t = cfg.train
    optimizer = build_optimizer(policy, lr=t.learning_rate, weight_decay=t.weight_decay,
                                betas=(t.adam_beta1, t.adam_beta2), master_weights=t.master_weights,
                                offload=t.optimizer_offload, eps=t.adam_epsilon)
    total_updates = t.max_steps * t.mini_batches * t.num_iterations
    scheduler = build_scheduler(optimizer, kind=t.lr_scheduler_type, warmup_steps=t.warmup_steps,
                                total_steps=total_updates, kwargs=t.lr_scheduler_kwargs)
    longest = _longest_prompt(train_data, eval_data)
    kv_fraction, memory_estimate = plan_memory(cfg, policy, device, reference is not None, echo, dtype=compute_dtype,
                                                 longest_prompt=_longest_prompt(train_data))  # trained on
    if sharded is None:
        engine = build_engine(cfg, policy, tokenizer, device, echo, kv_fraction, longest)
    else:
        from cohort.distributed.fsdp import GatheredEngine

        mirror, gather = sharded
        engine = GatheredEngine(build_engine(cfg, mirror, tokenizer, device, echo, kv_fraction, longest), gather)
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
        device=device, turn_loop=turn_loop, processor=processor, memory_estimate=memory_estimate)

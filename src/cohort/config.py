"""Every setting of a cohort run, with its default, in one place.

A run is configured by `CohortConfig`, a tree of dataclasses. Field names follow TRL's `GRPOConfig` where
the concept is the same (num_generations, max_completion_length, temperature, beta, epsilon, loss_type,
scale_rewards, num_iterations, ...), grouped into sections so a YAML recipe reads top to bottom:

    model:      what to train            generation: how completions are sampled
    data:       where prompts come from  reward:     how completions are scored
    loss:       the policy loss variant  advantage:  how rewards become advantages
    train:      batch schedule, optimiser, precision
    run:        output directory, logging, checkpoints, evaluation
    agent:      tools the model may call (multi-turn tool-calling rollouts)

Batch semantics, stated once: each step takes `train.prompts_per_step` prompts and samples
`generation.num_generations` completions for each. The step's completions are split into
`train.mini_batches` optimiser updates (verl's ppo_mini_batch), and the whole set is passed over
`train.num_iterations` times (TRL's num_iterations, PPO epochs). `train.token_budget` only caps the tokens of
one forward/backward (micro-batch): it changes speed and memory, never the maths.

Recipes are YAML files with the same tree; `apply_overrides` takes `section.field=value` strings from the
command line. Unknown keys fail with a "did you mean" suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cohort.config_checks import _require, _require_choice, _scheduler_names
from cohort.config_checks import validate_fields as _validate_fields
from cohort.errors import ConfigError


@dataclass
class ModelConfig:
    name_or_path: str = "smollm2-135m-instruct"  # hub id, local folder, .gguf file, or a cohort alias
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    gguf_file: str | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    compile_layers: bool = False  # CUDA: torch.compile each decoder layer for training (~8 s once; +50% MFU)
    lora_r: int = 0  # > 0: train LoRA adapters of this rank (peft) instead of every weight
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # vision-language models: no gradient into the vision tower and projector (the language model trains)
    freeze_vision: bool = False
    trust_remote_code: bool = False
    # None: the tokenizer's own; 'chatml_tools' (cohort's ChatML template with tools) or a .jinja path
    chat_template: str | None = None


@dataclass
class DataConfig:
    source: str = "reasoning_gym:chain_sum"  # file path, datasets name, reasoning_gym:<task>, or "pkg.mod:fn"
    options: dict[str, Any] = field(default_factory=dict)  # passed to the source (e.g. task settings)
    split: str = "train"
    prompt_column: str = "prompt"
    shuffle: bool = True  # draw prompts in a seeded random order (reshuffled every epoch); false: dataset order
    system_prompt: str | None = None
    # worked examples as chat messages (tool calls and tool results included), placed after the system
    # prompt and before each conversational prompt's own messages: a small model copies their format
    few_shot: list[dict[str, Any]] = field(default_factory=list)
    max_prompt_length: int = 512
    truncation: Literal["left", "drop"] = "left"  # left: keep the end of a long prompt (TRL); drop: skip the row
    eval_source: str | None = None  # default: a held-out split of `source`
    eval_options: dict[str, Any] = field(default_factory=dict)
    eval_size: int = 0


@dataclass
class GenerationConfig:
    num_generations: int = 8
    max_completion_length: int = 256
    # the engine's context limit, prompt + completion (vLLM's max_model_len); None: the model's context
    # (max_position_embeddings). Prompts longer than it minus max_completion_length are truncated or dropped
    # by the data stage (data.truncation), before training starts
    max_model_len: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_strings: list[str] = field(default_factory=list)
    mask_truncated_completions: bool = False
    ignore_eos: bool = False  # sample through EOS to max_completion_length (benchmarks, fixed-length runs)
    engine: str = "auto"  # auto: cohort's engine when the architecture is supported, else hf
    kv_cache_fraction: float = 0.3
    # free the engine's KV pool while the policy updates (TRL's vllm_enable_sleep_mode): the update can use
    # that memory; the next generate re-allocates it (same address in steady state, so no graph recapture)
    release_kv_during_update: bool = False
    fuse_projections: bool | None = None  # engine's fused QKV/gate-up weight copies; None: on for CUDA
    generation_batch_size: int | None = None  # hf engine only: prompts per generate call
    # rounds of tool calls per completion (TRL's name); None: only max_completion_length, over the whole
    # conversation (model turns and tool results), bounds them
    max_tool_calling_iterations: int | None = None
    # where completions are sampled: colocate (an engine in each trainer process, reading its weights in
    # place) or server (a `cohort serve` process on its own GPUs at server_address, host:port; the trainer
    # pushes its weights there after every step). docs/serving.md
    placement: str = "colocate"
    server_address: str | None = None
    server_timeout_s: float = 600.0  # longest one request to the server (a step's generation, a push) may take
    server_connect_timeout_s: float = 60.0  # how long to wait for a server to answer at start or after a restart
    # a weight push gives up (a named error) once the server has left /health unanswered this long
    server_liveness_timeout_s: float = 30.0


@dataclass
class RewardConfig:
    funcs: list[Any] = field(default_factory=lambda: ["accuracy"])  # names, "pkg.mod:fn", or {name: kwargs}
    reward_weights: list[float] | None = None
    timeout_s: float | None = None
    on_error: Literal["raise", "skip"] = "raise"  # skip: the sample's reward becomes None and is counted
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more
    max_resample_tries: int = 3
    max_oversample: int = 4  # a resampling try draws at most this many times the missing prompts


@dataclass
class AdvantageConfig:
    scale_rewards: str = "group"  # group | batch | none (Dr. GRPO)
    estimator: str = "grpo"  # grpo | rloo
    multi_objective_aggregation: str = "sum_then_normalize"


@dataclass
class LossConfig:
    """The policy loss: a name from the loss table (or "pkg.mod:Factory") and that loss's own parameters.

    Unset (None) parameters take the loss's default (see docs/algorithms.md). Any parameter of the chosen
    loss can be set as `loss.<name>=value` (e.g. loss.sapo_temperature_neg=1.1, loss.kl_estimator=k1); keys
    that are not fields here are kept in `params` and checked against the loss, with a "did you mean".
    """

    loss_type: str = "dapo"
    beta: float | None = None  # KL coefficient; > 0 loads a frozen reference model
    epsilon: float | None = None
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str | None = None  # token | sequence (GSPO)
    params: dict[str, Any] = field(default_factory=dict)

    def loss_params(self) -> dict[str, Any]:
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("loss_type", "params")}
        return {**{k: v for k, v in named.items() if v is not None}, **self.params}


@dataclass
class TrainConfig:
    max_steps: int = 100
    max_train_time_s: float | None = None  # also end training (normally) after this much step time
    prompts_per_step: int = 16
    mini_batches: int = 1
    num_iterations: int = 1
    token_budget: int = 16384
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    # a non-finite loss or gradient norm skips that optimiser update (counted as skipped_updates); this many
    # in a row stop the run with an error (exit 2) naming the step
    max_nonfinite_updates: int = 3
    # bf16/fp16 weights: keep fp32 master weights and fp32 Adam moments (default), or Adam moments in the
    # weights' dtype as TRL does (6 bytes/param less; the LM-head gradient is then also summed in bf16)
    master_weights: bool = True
    logprob_chunk_tokens: int = 4096  # tokens per chunk of the logprob kernel: its [chunk, vocab] buffers
    optimizer_offload: bool = False  # Adam moments in host memory, streamed per bucket in the step
    # none: every rank holds the whole model (data parallel); fsdp: FSDP2 shards weights, gradients and Adam
    # state over the ranks (one unit per decoder layer + the root), the engine gets gathered bf16 weights
    sharding: str = "none"
    # fsdp only. reshard_after_forward=false keeps each layer's gathered bf16 weights from its forward to its
    # backward (one all-gather per micro-batch instead of two; +1 bf16 model copy at peak). reduce_every_micro_
    # batch=false sums gradients unsharded (fp32) until the update's last micro-batch, then reduce-scatters
    # once (fewer collectives; +1 fp32 model-size gradient buffer). Speed and memory only, never the maths.
    fsdp_reshard_after_forward: bool = True
    fsdp_reduce_every_micro_batch: bool = True
    # cohort's constant | cosine (warmup then flat / cosine to 0), or any transformers scheduler name (linear,
    # cosine_with_min_lr, constant_with_warmup, ..., "hf:cosine"), built by transformers' get_scheduler
    lr_scheduler_type: str = "constant"
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)  # transformers' scheduler_specific_kwargs
    warmup_steps: int | float = 0  # optimiser updates; a value in (0, 1) is a fraction of them
    seed: int = 42
    device: str = "auto"
    # several ranks (torchrun): the longest any collective may wait for a peer before the rank fails and the
    # launch ends; keep it above the longest rank-0-only work the others wait through (evaluation, a save)
    dist_timeout_s: float = 600
    # generation.placement=server only: step t+1..t+k are generated while step t trains, with weights at most
    # k versions behind (the sampler importance weights correct for it); 0: on-policy, synchronous (exact)
    max_staleness: int = 0


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    overwrite: bool = False
    resume: bool | str = False  # true: from the newest checkpoint in output_dir; a path: from that checkpoint
    logging_steps: int = 1
    save_steps: int = 0  # 0: only at the end
    # false: no checkpoint when training ends (TRL's save_strategy='no' with save_steps=0: none at all);
    # run.time_limit_s still saves the checkpoint it stops at, to resume from
    save_at_end: bool = True
    save_total_limit: int | None = 2
    # TRL's name: checkpoints without optimizer state (about 2/3 smaller with Adam); --resume then loads the
    # weights, data position, schedule and RNG, and Adam's moments restart from zero (it says so)
    save_only_model: bool = False
    report_to: list[str] | None = None  # None: console, jsonl, and TensorBoard when installed; or wandb, trackio
    log_completions: bool = False
    eval_steps: int = 0  # 0: evaluate only before and after training
    eval_num_samples: int = 1  # n completions per eval prompt (pass@n); greedy when 1
    eval_max_prompts: int | None = None
    # the held-out eval's completion cap (None: generation.max_completion_length); lets a run train with a
    # short cap and still score before and after on the same, more generous one (verl's val_kwargs idea)
    eval_max_completion_length: int | None = None
    time_limit_s: float | None = None  # stop at a step boundary after this long, with a checkpoint; --resume


@dataclass
class AgentConfig:
    """Tool calling: with tools, each completion may call them, get the results and continue (multi-turn);
    the tool results are context, never trained on. Empty tools: plain single-turn completions."""

    tools: list[Any] = field(default_factory=list)  # functions or "pkg.module:function" paths
    tool_timeout_s: float = 10.0  # per call; a call that runs longer gets an error message instead
    # "pkg.module:function"(text, tokenizer) -> list[ToolCall]; None: cohort.agents.parse_tool_calls
    tool_parser: str | None = None
    # TRL's environment_factory: "pkg.module:Class" (or a class / zero-argument factory), or {name: that} routed
    # by the dataset's `environment` column. Each rollout gets its own instance: reset(**row) before it, its
    # methods as the rollout's tools, get_reward() (if defined) as one more reward column (weight 1).
    environment_factory: Any = None
    # run the tools and render their results on the engine's thread as each turn ends, instead of on a thread
    # pool: faster for tools that answer in about a millisecond (a calculator), wrong for slow ones (it stalls
    # generation while they run); see cohort.agents.rollout_loop
    inline_tools: bool = False


@dataclass
class CohortConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; a callable (a reward function handed in from Python) becomes its import path."""
        return _plain(dataclasses.asdict(self))

    @property
    def completions_per_step(self) -> int:
        return self.train.prompts_per_step * self.generation.num_generations

    def validate(self) -> CohortConfig:
        """Check cross-field rules before any work; each error names the field, the value and the fix."""
        g, t = self.generation, self.train
        _require(g.num_generations >= 2, "generation.num_generations", g.num_generations,
                 "GRPO normalises rewards within a group of completions of the same prompt; use 2 or more")
        _require(t.prompts_per_step >= 1, "train.prompts_per_step", t.prompts_per_step, "use 1 or more")
        _require(t.mini_batches >= 1 and t.prompts_per_step % t.mini_batches == 0, "train.mini_batches",
                 t.mini_batches, f"it must divide train.prompts_per_step={t.prompts_per_step} so every "
                 "optimiser update sees whole groups; choose a divisor")
        _require(t.num_iterations >= 1, "train.num_iterations", t.num_iterations, "use 1 or more")
        _require(t.max_steps >= 1, "train.max_steps", t.max_steps, "use 1 or more")
        _require(t.max_train_time_s is None or t.max_train_time_s > 0, "train.max_train_time_s",
                 t.max_train_time_s, "use a positive number of seconds, or leave it unset (null) for no limit")
        _require(self.run.time_limit_s is None or self.run.time_limit_s > 0, "run.time_limit_s",
                 self.run.time_limit_s, "use a positive number of seconds, or leave it unset (null) for no limit")
        _require(t.dist_timeout_s > 0, "train.dist_timeout_s", t.dist_timeout_s,
                 "use a positive number of seconds (default 600), longer than rank 0's evaluation or save")
        _require(g.max_completion_length >= 1, "generation.max_completion_length", g.max_completion_length,
                 "use 1 or more")
        _require(self.run.eval_max_completion_length is None or self.run.eval_max_completion_length >= 1,
                 "run.eval_max_completion_length", self.run.eval_max_completion_length,
                 "use 1 or more, or leave it unset to use generation.max_completion_length")
        _require(g.temperature >= 0, "generation.temperature", g.temperature, "use 0 (greedy) or more")
        _require(0 < g.top_p <= 1, "generation.top_p", g.top_p, "use a value in (0, 1]")
        _require(t.token_budget >= 1, "train.token_budget", t.token_budget, "use a positive token count")
        _require(self.reward.max_oversample >= 1, "reward.max_oversample", self.reward.max_oversample,
                 "use 1 (draw only the missing prompts) or more")
        _require(self.reward.max_resample_tries >= 1, "reward.max_resample_tries", self.reward.max_resample_tries,
                 "use 1 or more")
        _require(not (t.optimizer_offload and t.master_weights), "train.optimizer_offload", t.optimizer_offload,
                 "offloaded Adam moments are kept in the weights' dtype; set train.master_weights=false with it")
        _require_choice("train.sharding", t.sharding, ("none", "fsdp"),
                        " ('none': data parallel, a whole model per rank; 'fsdp': FSDP2 sharding)")
        _require(not (t.sharding == "fsdp" and t.optimizer_offload), "train.optimizer_offload", t.optimizer_offload,
                 "with train.sharding=fsdp the Adam state is already split over the ranks; set it to false")
        _require(t.logprob_chunk_tokens >= 1, "train.logprob_chunk_tokens", t.logprob_chunk_tokens,
                 "use a positive token count (e.g. 1024; smaller saves memory, larger launches fewer kernels)")
        _require_choice("data.truncation", self.data.truncation, ("left", "drop"))
        _require_choice("generation.engine", g.engine, ("auto", "cohort", "hf"))
        _require_choice("reward.on_error", self.reward.on_error, ("raise", "skip"))
        close = difflib.get_close_matches(str(t.lr_scheduler_type), _scheduler_names(), n=1, cutoff=0.6)
        _require(t.lr_scheduler_type.removeprefix("hf:") in _scheduler_names(), "train.lr_scheduler_type",
                 t.lr_scheduler_type, (f"did you mean '{close[0]}'? " if close else "")
                 + "use 'constant' or 'cosine' (cohort's) or one of transformers' "
                 f"{', '.join(n for n in _scheduler_names() if n not in ('constant', 'cosine'))}")
        from cohort.algorithms import build_policy_loss

        try:  # unknown loss names and parameters fail here, before any work
            build_policy_loss(self.loss.loss_type, self.loss.loss_params())
        except ConfigError:
            raise
        except (ValueError, TypeError, ImportError) as exc:
            raise ConfigError(f"loss (loss.loss_type={self.loss.loss_type!r}): {exc} Set it as loss.<name>=value."
                              ) from exc
        _require(isinstance(t.max_nonfinite_updates, int) and t.max_nonfinite_updates >= 1,
                 "train.max_nonfinite_updates", t.max_nonfinite_updates,
                 "use 1 or more: how many optimiser updates in a row may be skipped for a non-finite loss or "
                 "gradient norm before the run stops")
        _require(g.max_tool_calling_iterations is None or g.max_tool_calling_iterations >= 0,
                 "generation.max_tool_calling_iterations", g.max_tool_calling_iterations,
                 "use 0 or more rounds of tool calls, or leave it unset (null) for no cap")
        _require(self.agent.tool_timeout_s > 0, "agent.tool_timeout_s", self.agent.tool_timeout_s,
                 "use a positive number of seconds")
        _require(isinstance(self.agent.inline_tools, bool), "agent.inline_tools", self.agent.inline_tools,
                 "use true (tools run on the engine's thread) or false (on a thread pool)")
        factory = self.agent.environment_factory
        _require(factory is None or isinstance(factory, str) or callable(factory)
                 or (isinstance(factory, dict) and bool(factory) and all(isinstance(v, str) or callable(v)
                                                                    for v in factory.values())),
                 "agent.environment_factory", factory,
                 "give 'pkg.module:Class', or a mapping {name: 'pkg.module:Class'} routed by the 'environment' column")
        weights = self.reward.reward_weights
        _require(weights is None or len(weights) == len(self.reward.funcs), "reward.reward_weights", weights,
                 f"give one weight per reward function ({len(self.reward.funcs)})")
        _validate_fields(self)
        from cohort.preflight import check_inputs

        check_inputs(self)  # data options against the source, reward names and kwargs, tool import paths
        return self


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', type(value).__name__)}"
    return value


# ---------------------------------------------------------------------------------------------------------
# YAML and dotted overrides


def _section_types() -> dict[str, type]:
    defaults = CohortConfig()  # every field is a section dataclass with a default factory
    return {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(CohortConfig)}


def _did_you_mean(key: str, options: list[str]) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(sorted(options))}."


def _all_dotted_keys() -> list[str]:
    keys = []
    for name, cls in _section_types().items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _set(cfg: CohortConfig, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = _section_types()
    if parts[0] not in sections:
        # a bare field name (e.g. "num_generations") is accepted when it is unique across sections
        owners = [s for s, cls in sections.items() if parts[0] in {f.name for f in dataclasses.fields(cls)}]
        if len(parts) == 1 and len(owners) == 1:
            parts = [owners[0], parts[0]]
        else:
            raise ConfigError(f"Unknown config key '{dotted}'.{_did_you_mean(dotted, _all_dotted_keys())}")
    if len(parts) < 2:
        raise ConfigError(f"Config key '{dotted}' names a section; set one of its fields, e.g. "
                          f"{parts[0]}.{dataclasses.fields(sections[parts[0]])[0].name}=...")
    section = getattr(cfg, parts[0])
    names = [f.name for f in dataclasses.fields(section)]
    if parts[0] == "loss" and parts[1] not in names and len(parts) == 2:
        section.params[parts[1]] = value  # a loss-specific parameter, checked by the loss itself
        return
    if parts[1] not in names:
        raise ConfigError(f"Unknown config key '{dotted}'.{_did_you_mean(parts[1], names)} "
                          f"(fields of '{parts[0]}': {', '.join(names)})")
    if len(parts) > 2:  # into a dict-valued field, e.g. data.options.min_terms=2 or loss.params.tau_pos=1
        target = getattr(section, parts[1])
        if not isinstance(target, dict):
            raise ConfigError(f"Config key '{dotted}': '{parts[0]}.{parts[1]}' is not a mapping.")
        for p in parts[2:-1]:
            target = target.setdefault(p, {})
        target[parts[-1]] = value
        return
    annotation = str(next(f.type for f in dataclasses.fields(section) if f.name == parts[1]))
    setattr(section, parts[1], _coerce(dotted, annotation, value))


def _coerce(dotted: str, annotation: str, value: Any) -> Any:
    """Match YAML's guess to the field's type: YAML 1.1 reads `2e-6` as a string, `1` as an int."""
    if value is None or not isinstance(value, str | int | float) or isinstance(value, bool):
        if annotation.startswith("list") and isinstance(value, str):
            return [value]
        return value
    kind = annotation.split("|")[0].strip()
    try:
        if kind == "float":
            return float(value)
        if kind == "int" and (isinstance(value, str) or float(value).is_integer()):
            return int(float(value)) if isinstance(value, float) else int(value)
    except ValueError:
        raise ConfigError(f"{dotted}={value!r} is not a valid {kind}; give a number, e.g. {dotted}=1") from None
    if annotation.startswith("list") and isinstance(value, str):
        return [value]
    return value


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and prefix == "":
            out += _flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def config_from_dict(tree: dict[str, Any] | None, base: CohortConfig | None = None) -> CohortConfig:
    cfg = base or CohortConfig()
    for dotted, value in _flatten(tree or {}):
        _set(cfg, dotted, value)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> CohortConfig:
    """Read a YAML recipe (or the defaults when path is None), apply `key=value` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe={str(path)!r} does not exist; give the path to a YAML recipe "
                              "(see recipes/ in the repository).")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"recipe={str(path)!r} is not valid YAML{where}: {what}; fix that line (each "
                              "section is a mapping, e.g. 'train:' then '  max_steps: 3').") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe={str(path)!r} must be a mapping of sections, got {type(tree).__name__}.")
    cfg = config_from_dict(tree)
    apply_overrides(cfg, overrides or [])
    return cfg.validate()


def apply_overrides(cfg: CohortConfig, overrides: list[str]) -> CohortConfig:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} must look like section.field=value, e.g. loss.epsilon=0.3.")
        key, raw = item.split("=", 1)
        _set(cfg, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return cfg


def dump_config(cfg: CohortConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

"""The sections of a run's config, one dataclass each, with every field's default.

Field order is the order a saved `config.yaml`, `cohort train --print-config` and the docs show, so new fields
go where they read best, not at the end. `from __future__ import annotations` is load-bearing: the override
parser (`cohort.config.overrides._coerce`) reads each field's annotation as a string ("float", "int | None",
"list[str]") to turn YAML's guess into the field's type.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ModelConfig:
    name_or_path: str = "smollm2-135m-instruct"  # hub id, local folder, .gguf file, or a cohort alias
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    gguf_file: str | None = None
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    compile_layers: bool = False  # CUDA: torch.compile each decoder layer for training (~8 s once; +50% MFU)
    # the training forward's packed attention on CUDA: torch (built-in FlashAttention-2) or fa4
    # (FlashAttention-4, `pip install flash-attn-4`, Hopper/Blackwell; docs/training.md)
    packed_attention: Literal["torch", "fa4"] = "torch"
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
    # keep the forward's LM-head logits for the backward instead of recomputing them (a faster backward); costs
    # the completion tokens of a micro-batch x vocab x weight-dtype bytes (Qwen2.5, 16k tokens: ~4.6 GiB in bf16)
    keep_logits: bool = False
    # pack each prompt once per micro-batch with its completions after it (they attend to it; exact, and the
    # prompt's G - 1 copies skip the model: a third fewer decoder FLOPs at 128 + 256 tokens); cohort.forward.shared_prompts
    share_prompts: bool = True
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

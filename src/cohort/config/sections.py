"""The sections of a run's config, one dataclass each, with every field's default and help text.

Field order is the order a saved `config.yaml`, `cohort train --print-config` and the docs show, so new fields
go where they read best, not at the end. `from __future__ import annotations` is load-bearing: the override
parser (`cohort.config.overrides._coerce`) reads each field's annotation as a string ("float", "int | None",
"list[str]") to turn YAML's guess into the field's type.

Every field is declared with `setting(default, help=...)`: its help text lives in the field's metadata, where
`cohort train --help-config`, docs/settings.md (`python -m cohort.config.help --write docs/settings.md`) and
the "did you mean" of an unknown key read it.
"""

# RUF009 (a function call as a dataclass default): `setting` returns dataclasses.field, which ruff cannot see
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

_MISSING: Any = dataclasses.MISSING


def setting(default: Any = _MISSING, *, default_factory: Callable[[], Any] = _MISSING, help: str) -> Any:
    """A dataclass field with its default (or default_factory) and a one-line help text in metadata["help"]."""
    if not help.strip():
        raise ValueError("every setting needs a help text")
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(field: dataclasses.Field) -> str:
    """A field's help text ("" when it has none)."""
    return str(field.metadata.get("help", ""))


@dataclass
class ModelConfig:
    name_or_path: str = setting(
        "smollm2-135m-instruct", help="the model to train: a hub id, a local folder, a .gguf file, or a cohort alias")
    dtype: str = setting("auto", help="weight dtype (float32, bfloat16, float16, ...); auto: bfloat16 on GPU, "
                                      "float32 on CPU")
    gguf_file: str | None = setting(
        None, help="a .gguf file to load the weights from (relative to model.name_or_path when that is a folder); "
                   "None: name_or_path alone says what to load")
    attn_implementation: str | None = setting(
        None, help="transformers' attn_implementation when loading the model (eager, sdpa, flash_attention_2, ...); "
                   "None: transformers' choice")
    gradient_checkpointing: bool = setting(
        False, help="recompute each decoder layer's activations in the backward: less memory, a slower update")
    compile_layers: bool = setting(
        False, help="CUDA: torch.compile each decoder layer for training (~8 s once; +50% MFU)")
    packed_attention: Literal["torch", "fa4"] = setting(
        "torch", help="the training forward's packed attention on CUDA: torch (built-in FlashAttention-2) or fa4 "
                      "(FlashAttention-4, `pip install flash-attn-4`, Hopper/Blackwell; docs/training.md)")
    lora_r: int = setting(0, help="> 0: train LoRA adapters of this rank (peft) instead of every weight; "
                                  "0: full fine-tuning")
    lora_alpha: int = setting(32, help="LoRA scale: the adapters' output is multiplied by lora_alpha / lora_r "
                                       "(with lora_r > 0)")
    lora_dropout: float = setting(0.0, help="dropout probability on the LoRA adapters' input, in [0, 1) "
                                            "(with lora_r > 0)")
    lora_target_modules: list[str] = setting(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        help="names of the linear modules that get LoRA adapters (with lora_r > 0)")
    quantization: Literal["none", "nf4", "fp4"] = setting(
        "none", help="QLoRA: load the base weights in 4 bits through bitsandbytes (nf4 or fp4, double-quantised, "
                     "computing in model.dtype) and train LoRA adapters on them; needs model.lora_r > 0, a CUDA GPU "
                     "and `pip install 'cohort-rl[qlora]'`; none: the weights in model.dtype (docs/training.md)")
    freeze_vision: bool = setting(
        False, help="vision-language models: no gradient into the vision tower and projector (the language model "
                    "trains)")
    trust_remote_code: bool = setting(
        False, help="let transformers run the model repository's own Python code (models not built into "
                    "transformers)")
    chat_template: str | None = setting(
        None, help="None: the tokenizer's own; 'chatml_tools' (cohort's ChatML template with tools) or a .jinja path")


@dataclass
class DataConfig:
    source: str = setting(
        "reasoning_gym:chain_sum",
        help='the training prompts: a file path, a datasets name, reasoning_gym:<task>, or "pkg.mod:fn"')
    options: dict[str, Any] = setting(
        default_factory=dict, help="passed to the source (e.g. task settings such as {size: 500})")
    split: str = setting("train", help="the dataset split to read the training prompts from")
    prompt_column: str = setting("prompt", help="the column that holds each prompt (text or chat messages)")
    shuffle: bool = setting(
        True, help="draw prompts in a seeded random order (reshuffled every epoch); false: dataset order")
    system_prompt: str | None = setting(
        None, help="a system message put before every prompt; None: no system message")
    few_shot: list[dict[str, Any]] = setting(
        default_factory=list,
        help="worked examples as chat messages (tool calls and tool results included), placed after the system "
             "prompt and before each conversational prompt's own messages: a small model copies their format")
    max_prompt_length: int = setting(
        512, help="longest prompt in tokens; longer ones are handled as data.truncation says")
    truncation: Literal["left", "drop"] = setting(
        "left", help="left: keep the end of a long prompt (TRL); drop: skip the row")
    eval_source: str | None = setting(
        None, help="held-out prompts for evaluation, in any form data.source takes; None: a held-out split of "
                   "`source` (data.eval_size)")
    eval_options: dict[str, Any] = setting(
        default_factory=dict, help="passed to eval_source as data.options is to source (needs data.eval_source)")
    eval_size: int = setting(
        0, help="prompts held out of `source` for evaluation (without eval_source); 0: no held-out split")


@dataclass
class GenerationConfig:
    num_generations: int = setting(
        8, help="completions sampled per prompt (the group size G; at least 2)")
    max_completion_length: int = setting(
        256, help="most tokens in one completion (a multi-turn completion's model turns and tool results together)")
    max_model_len: int | None = setting(
        None, help="the engine's context limit, prompt + completion (vLLM's max_model_len); None: the model's "
                   "context (max_position_embeddings). Prompts longer than it minus max_completion_length are "
                   "truncated or dropped by the data stage (data.truncation), before training starts")
    temperature: float = setting(1.0, help="sampling temperature; 0: greedy")
    top_p: float = setting(1.0, help="nucleus sampling: sample from the most likely tokens whose probabilities "
                                     "sum to top_p, in (0, 1]; 1: off")
    top_k: int = setting(0, help="sample from the k most likely tokens only; 0: off")
    min_p: float = setting(0.0, help="drop tokens less likely than min_p times the most likely one, in [0, 1]; "
                                     "0: off")
    repetition_penalty: float = setting(
        1.0, help="penalise every token already in the prompt or completion (HF semantics: its logit is divided "
                  "by it when positive, multiplied when negative); 1.0: off, > 1 discourages repeats")
    stop_strings: list[str] = setting(
        default_factory=list, help="a completion ends (stop text included) when it produces one of these strings")
    mask_truncated_completions: bool = setting(
        False, help="completions cut off at max_completion_length (no EOS) get no loss (DAPO's overlong filter)")
    ignore_eos: bool = setting(
        False, help="sample through EOS to max_completion_length (benchmarks, fixed-length runs)")
    engine: str = setting("auto", help="auto: cohort's engine when the architecture is supported, else hf")
    kv_cache_fraction: float = setting(
        0.3, help="share of the device's free memory (after the trainer's) given to the engine's KV cache, "
                  "in (0, 1]")
    release_kv_during_update: bool = setting(
        False, help="free the engine's KV pool while the policy updates (TRL's vllm_enable_sleep_mode): the update "
                    "can use that memory; the next generate re-allocates it (same address in steady state, so no "
                    "graph recapture)")
    logprob_parity: Literal["fast", "exact"] = setting(
        "fast", help="exact: the engine and the trainer run one batch-invariant forward (Triton), so the sampling "
                     "logprobs equal the trainer's bit for bit and the old-logprob pass is skipped (Llama, Mistral, Qwen2, "
                     "Qwen3, Gemma 3; rows without shared prompts); fast: their own kernels (a small mismatch, corrected by "
                     "importance sampling). docs/training.md#logprob-parity")
    fuse_projections: bool | None = setting(
        None, help="engine's fused QKV/gate-up weight copies; None: on for CUDA (off for a 4-bit base's merged "
                   "copy)")
    quantized_engine: Literal["merged_bf16", "4bit"] = setting(
        "merged_bf16", help="with a 4-bit base (model.quantization): what cohort's engine samples from: merged_bf16 "
                            "(a dequantised copy in model.dtype with the LoRA adapters merged, refreshed after each "
                            "optimizer step: plain matmuls, 2 more bytes per base weight) or 4bit (the trainer's own "
                            "4-bit layers and adapters in place: no copy, bitsandbytes matmuls)")
    lora_engine: Literal["adapters", "merged"] = setting(
        "adapters", help="with LoRA on a model.dtype base (model.lora_r > 0, model.quantization=none): what cohort's "
                         "engine samples from: adapters (the base in place with the adapters unmerged: two small "
                         "matmuls more per projection per decode step) or merged (a copy of the adapted layers with "
                         "the adapters merged, refreshed after each optimizer step: plain matmuls, the adapted "
                         "weights' bytes once more). docs/training.md#lora-engine")
    generation_batch_size: int | None = setting(
        None, help="hf engine only: rows (a prompt's copy per completion) per generate call; None: all of them at once")
    hf_generate_kwargs: dict[str, Any] = setting(
        default_factory=dict, help="engine=hf only: more transformers GenerationConfig options (num_beams, "
                                   "length_penalty, no_repeat_ngram_size, ...); with num_beams > 1 the logprobs "
                                   "are recomputed by a forward over each completion")
    max_tool_calling_iterations: int | None = setting(
        None, help="rounds of tool calls per completion (TRL's name); None: only max_completion_length, over the "
                   "whole conversation (model turns and tool results), bounds them")
    placement: str = setting(
        "colocate", help="where completions are sampled: colocate (an engine in each trainer process, reading its "
                         "weights in place) or server (a `cohort serve` process on its own GPUs at "
                         "server_address; the trainer pushes its weights there after every step). docs/serving.md")
    server_address: str | None = setting(
        None, help="placement=server: the `cohort serve` process's host:port (e.g. 127.0.0.1:8000)")
    server_timeout_s: float = setting(
        600.0, help="longest one request to the server (a step's generation, a push) may take, in seconds")
    server_connect_timeout_s: float = setting(
        60.0, help="how long to wait for a server to answer at start or after a restart, in seconds")
    server_liveness_timeout_s: float = setting(
        30.0, help="a weight push gives up (a named error) once the server has left /health unanswered this long, "
                   "in seconds")


@dataclass
class RewardConfig:
    funcs: list[Any] = setting(
        default_factory=lambda: ["accuracy"], help='reward functions: names, "pkg.mod:fn", or {name: kwargs}')
    reward_weights: list[float] | None = setting(
        None, help="one weight per reward function, in order (negative: a penalty); None: 1.0 each")
    timeout_s: float | None = setting(
        300.0, help="longest one reward function call may take, in seconds (an overrun is an error naming the "
                    "function, or a skipped batch with on_error=skip); null: no limit")
    on_error: Literal["raise", "skip"] = setting(
        "raise", help="a reward function that raises: raise stops the run; skip: the sample's reward becomes None "
                      "and is counted")
    dynamic_sampling: bool = setting(False, help="DAPO: drop groups whose rewards are all equal, sample more")
    max_resample_tries: int = setting(
        3, help="with dynamic_sampling: sampling tries per step; the last one fills the step, all-equal groups "
                "included")
    max_oversample: int = setting(
        4, help="a resampling try draws at most this many times the missing prompts")


@dataclass
class AdvantageConfig:
    scale_rewards: str = setting(
        "group", help="divide advantages by the std of: group (each group's), batch (the batch's), none (Dr. GRPO)")
    estimator: str = setting(
        "grpo", help="grpo (group mean baseline) | rloo (leave-one-out) | reinforce_plus_plus (batch-whitened) | "
                     "reinforce_plus_plus_baseline | remax (greedy baseline) | opo (length-weighted) | gpg | "
                     '"pkg.mod:Class"; all but grpo and rloo ignore scale_rewards (docs/algorithms.md)')
    multi_objective_aggregation: str = setting(
        "sum_then_normalize", help="several reward functions: sum_then_normalize (weighted sum, then advantages) "
                                   "or normalize_then_sum (normalise each reward, then sum; grpo only)")


@dataclass
class LossConfig:
    """The policy loss: a name from the loss table (or "pkg.mod:Factory") and that loss's own parameters.

    Unset (None) parameters take the loss's default (see docs/algorithms.md). Any parameter of the chosen
    loss can be set as `loss.<name>=value` (e.g. loss.sapo_temperature_neg=1.1, loss.kl_estimator=k1); keys
    that are not fields here are kept in `params` and checked against the loss, with a "did you mean".
    """

    loss_type: str = setting(
        "dapo", help='the policy loss: a name from docs/algorithms.md (grpo, dapo, dr_grpo, cispo, sapo, ...) or '
                     '"pkg.mod:Factory"')
    beta: float | None = setting(
        None, help="KL coefficient; > 0 loads a frozen reference model; None: the loss's default (0.0)")
    epsilon: float | None = setting(
        None, help="lower clip range: the ratio is clipped at 1 - epsilon; None: the loss's default (0.2)")
    epsilon_high: float | None = setting(
        None, help="upper clip range: the ratio is clipped at 1 + epsilon_high; None: the loss's default "
                   "(epsilon; cispo: 5.0)")
    delta: float | None = setting(
        None, help="two-sided clip: the unclipped ratio is capped at delta (INTELLECT-2); None: off")
    importance_sampling_level: str | None = setting(
        None, help="token | sequence (GSPO); None: the loss's default")
    router_aux_loss_coef: float | None = setting(
        None, help="weight of the router load-balancing loss of a mixture-of-experts model (as TRL's "
                   "router_aux_loss_coef; logged as aux_loss); None: the model config's own coefficient (Qwen3-MoE: "
                   "0.001; dense models: none); 0.0: off")
    params: dict[str, Any] = setting(
        default_factory=dict, help="the chosen loss's other parameters, set as loss.<name>=value and checked "
                                   "against the loss")

    def loss_params(self) -> dict[str, Any]:
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("loss_type", "params", "router_aux_loss_coef")}
        return {**{k: v for k, v in named.items() if v is not None}, **self.params}


@dataclass
class TrainConfig:
    max_steps: int = setting(100, help="training steps (each samples, scores and updates on one batch)")
    max_train_time_s: float | None = setting(
        None, help="also end training (normally) after this much step time, in seconds; None: no limit")
    prompts_per_step: int = setting(16, help="prompts sampled per step (each gets generation.num_generations "
                                             "completions)")
    mini_batches: int = setting(
        1, help="optimiser updates per pass over the step's completions; must divide prompts_per_step")
    num_iterations: int = setting(1, help="passes over the step's completions (TRL's num_iterations, PPO epochs)")
    token_budget: int = setting(
        16384, help="most tokens in one packed forward/backward (micro-batch); speed and memory only, never the "
                    "maths")
    learning_rate: float = setting(1e-6, help="peak learning rate of the optimiser (AdamW)")
    weight_decay: float = setting(0.0, help="AdamW's decoupled weight decay; 0: off")
    adam_beta1: float = setting(0.9, help="AdamW's beta1 (first-moment decay), in [0, 1)")
    adam_beta2: float = setting(0.99, help="AdamW's beta2 (second-moment decay), in [0, 1)")
    adam_epsilon: float = setting(1e-8, help="AdamW's epsilon, added to the denominator")
    max_grad_norm: float = setting(1.0, help="clip the gradient's global norm to this before each update")
    max_nonfinite_updates: int = setting(
        3, help="a non-finite loss or gradient norm skips that optimiser update (counted as skipped_updates); "
                "this many in a row stop the run with an error (exit 2) naming the step")
    master_weights: bool = setting(
        True, help="bf16/fp16 weights: keep fp32 master weights and fp32 Adam moments (default), or Adam moments "
                   "in the weights' dtype as TRL does (6 bytes/param less; the LM-head gradient is then also "
                   "summed in bf16)")
    logprob_chunk_tokens: int = setting(
        4096, help="tokens per chunk of the logprob kernel: its [chunk, vocab] buffers")
    keep_logits: bool = setting(
        False, help="keep the forward's LM-head logits for the backward instead of recomputing them (a faster "
                    "backward); costs the completion tokens of a micro-batch x vocab x weight-dtype bytes "
                    "(Qwen2.5, 16k tokens: ~4.6 GiB in bf16)")
    share_prompts: bool = setting(
        True, help="pack each prompt once per micro-batch with its completions after it (they attend to it; exact, "
                   "and the prompt's G - 1 copies skip the model: a third fewer decoder FLOPs at 128 + 256 "
                   "tokens); cohort.forward.shared_prompts")
    router_replay: bool = setting(
        False, help="mixture-of-experts policies (R3): cohort's engine records the top-k experts each token was routed "
                    "to, and the update's forwards use them instead of their own top-k (the router's softmax still "
                    "trains); narrows the train/inference logprob mismatch. Colocated cohort engine only "
                    "(docs/algorithms.md)")
    optimizer_offload: bool = setting(
        False, help="Adam moments in host memory, streamed per bucket in the step")
    sharding: str = setting(
        "none", help="none: every rank holds the whole model (data parallel); fsdp: FSDP2 shards weights, "
                     "gradients and Adam state over the ranks (one unit per decoder layer + the root), the engine "
                     "gets gathered bf16 weights")
    fsdp_reshard_after_forward: bool = setting(
        True, help="fsdp only. false keeps each layer's gathered bf16 weights from its forward to its backward "
                   "(one all-gather per micro-batch instead of two; +1 bf16 model copy at peak). Speed and memory "
                   "only, never the maths")
    fsdp_reduce_every_micro_batch: bool = setting(
        True, help="fsdp only. false sums gradients unsharded (fp32) until the update's last micro-batch, then "
                   "reduce-scatters once (fewer collectives; +1 fp32 model-size gradient buffer). Speed and memory "
                   "only, never the maths")
    context_parallel: int = setting(
        1, help="ranks per context-parallel group: each packed row (micro-batch) is split over the group's ranks by "
                "position (zig-zag chunks, K/V all-gathered in each attention layer; exact), for sequences whose "
                "activations do not fit one GPU; must divide the number of ranks; 1: off (docs/training.md, "
                "\"Context parallelism\")")
    lr_scheduler_type: str = setting(
        "constant", help="cohort's constant | cosine (warmup then flat / cosine to 0), or any transformers "
                         "scheduler name (linear, cosine_with_min_lr, constant_with_warmup, ..., \"hf:cosine\"), "
                         "built by transformers' get_scheduler")
    lr_scheduler_kwargs: dict[str, Any] = setting(
        default_factory=dict, help="transformers' scheduler_specific_kwargs (e.g. {min_lr_rate: 0.1})")
    warmup_steps: int | float = setting(
        0, help="learning-rate warmup in optimiser updates; a value in (0, 1) is a fraction of them; 0: none")
    seed: int = setting(42, help="seeds every random draw of the run: data order, sampling, LoRA init")
    deterministic: bool = setting(
        False, help="bitwise repeatable runs: the same seed, config and hardware give identical weights and "
                    "metrics (torch's deterministic algorithms, cuDNN without autotuning, cuBLAS's fixed "
                    "workspace); docs/benchmarks.md gives its cost in speed")
    device: str = setting("auto", help="auto (cuda when available, else cpu), cpu, cuda or cuda:<index>")
    dist_timeout_s: float = setting(
        600, help="several ranks (torchrun): the longest any collective may wait for a peer before the rank fails "
                  "and the launch ends, in seconds; keep it above the longest rank-0-only work the others wait "
                  "through (evaluation, a save)")
    max_staleness: int = setting(
        0, help="placement=server: steps t+1..t+k are generated while step t trains; with async_rollouts: groups "
                "stay in the engine across up to k updates. No token is more than k versions behind the weights "
                "trained (sampler importance weights correct for it); 0: on-policy, synchronous (exact)")
    async_rollouts: bool = setting(
        False, help="colocated cohort engine: a step trains on the first groups to finish, the rest keep decoding "
                    "with the new weights after the update (partial rollouts), up to (max_staleness + 1) x "
                    "prompts_per_step groups in flight; for long-tailed lengths. false: each step waits for its "
                    "longest sequence (docs/training.md, \"Asynchronous rollouts\")")


@dataclass
class RunConfig:
    output_dir: str = setting(
        "runs/default", help="the run directory: config.yaml, metrics, samples, TensorBoard, checkpoints")
    overwrite: bool = setting(
        False, help="delete an existing run directory (one that looks like a cohort run) and start again")
    resume: bool | str = setting(
        False, help="true: from the newest checkpoint in output_dir; a path: from that checkpoint")
    logging_steps: int = setting(
        1, help="steps between TRL callbacks' on_log events (the TRL facade); metrics.jsonl has every step")
    save_steps: int = setting(0, help="save a checkpoint every this many steps; 0: only at the end")
    save_at_end: bool = setting(
        True, help="false: no checkpoint when training ends (TRL's save_strategy='no' with save_steps=0: none at "
                   "all); run.time_limit_s still saves the checkpoint it stops at, to resume from")
    save_total_limit: int | None = setting(
        2, help="keep only the newest this many checkpoints (older ones are deleted); None: keep every one")
    save_only_model: bool = setting(
        False, help="TRL's name: checkpoints without optimizer state (about 2/3 smaller with Adam); --resume then "
                    "loads the weights, data position, schedule and RNG, and Adam's moments restart from zero (it "
                    "says so)")
    report_to: list[str] | None = setting(
        None, help="where metrics go: a list of console, jsonl, tensorboard, wandb, trackio (or all, none); None: "
                   "console, jsonl, and TensorBoard when installed")
    log_completions: bool = setting(
        False, help="write each step's prompts, completions and rewards to samples.jsonl")
    eval_steps: int = setting(0, help="evaluate every this many steps; 0: evaluate only before and after training")
    eval_num_samples: int = setting(1, help="n completions per eval prompt (pass@n); greedy when 1")
    eval_max_prompts: int | None = setting(
        None, help="evaluate on at most this many held-out prompts; None: all of them")
    eval_max_completion_length: int | None = setting(
        None, help="the held-out eval's completion cap (None: generation.max_completion_length); lets a run train "
                   "with a short cap and still score before and after on the same, more generous one (verl's "
                   "val_kwargs idea)")
    time_limit_s: float | None = setting(
        None, help="stop at a step boundary after this long, in seconds, with a checkpoint to --resume from; "
                   "None: no limit")

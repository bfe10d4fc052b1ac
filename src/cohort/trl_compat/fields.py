"""Every field of TRL 1.16's `GRPOConfig` (and of the transformers `TrainingArguments` it inherits), its TRL
default, and what cohort does with it. This table is the facade: `GRPOConfig` is built from it, `to_cohort`
applies it, docs/trl_compat.md is generated from it (`python -m cohort.trl_compat.fields > ...`).

A status is one of
    "<section.field>"        mapped: the value is copied into cohort's config (loss.* only where the chosen loss
                             has that parameter, as TRL's losses read only their own)
    "derived: <how>"         mapped through a conversion in `derived.py` (`DERIVED`): batch arithmetic,
                             unit changes, values that select among cohort settings
    "trainer: <how>"         used by `GRPOTrainer` itself (callbacks, push_to_hub, evaluation, model loading)
    "announce: <what>"       accepted; when set to anything but TRL's default, one log line says what cohort
                             does instead (the setting tunes machinery cohort does not have)
    "reject: <alternative>"  accepted only at TRL's default; any other value raises ConfigError naming the field
                             and the alternative (it would change the maths in a way cohort cannot honour)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_ONE_PROCESS = "cohort's launcher is torchrun (`torchrun -m cohort.cli train ...`); rank 0 logs and saves"
_VLLM = "cohort samples with its own rollout engine, which reads the trainer's weights in place (no vLLM)"
_DATALOADER = "prompts are tokenised once up front and drawn by cohort's seeded, resumable sampler"
_EVAL_LOOP = ("cohort's evaluate() generates on eval_dataset in one pass: eval_loss on sampled groups and the "
              "mean rewards (no batched prediction loop)")

# (name, TRL 1.16 default, status). Order: TrainingArguments as TRL lists them, then GRPOConfig's own.
FIELDS: list[tuple[str, Any, str]] = [
    ("output_dir", None, "derived: run.output_dir; None is transformers' 'trainer_output'"),
    ("per_device_train_batch_size", 8, "derived: completions per optimiser step (with gradient_accumulation_steps); "
     "train.prompts_per_step and train.mini_batches follow TRL's batch arithmetic"),
    ("num_train_epochs", 3.0, "derived: train.max_steps from the dataset size when max_steps <= 0, as TRL counts"),
    ("max_steps", -1, "derived: train.max_steps = ceil(max_steps / optimiser steps per generation)"),
    ("learning_rate", 1e-06, "train.learning_rate"),
    ("lr_scheduler_type", "linear", "derived: train.lr_scheduler_type, transformers' get_scheduler by the same name"),
    ("lr_scheduler_kwargs", None, "derived: train.lr_scheduler_kwargs, transformers' scheduler_specific_kwargs"),
    ("warmup_steps", 0, "derived: train.warmup_steps (a value below 1 is a fraction of the optimiser steps)"),
    ("optim", "adamw_torch_fused", "derived: adamw_torch / adamw_torch_fused are cohort's AdamW (fused on CUDA); "
     "any other optimiser is rejected"),
    ("optim_args", None, "reject: cohort's optimiser is AdamW; set its hyperparameters with learning_rate, "
     "adam_beta1, adam_beta2, weight_decay"),
    ("weight_decay", 0.0, "train.weight_decay"),
    ("adam_beta1", 0.9, "train.adam_beta1"),
    ("adam_beta2", 0.999, "train.adam_beta2"),
    ("adam_epsilon", 1e-08, "train.adam_epsilon"),
    ("optim_target_modules", None, "reject: cohort trains every parameter that requires grad; "
     "freeze modules on the model object instead"),
    ("gradient_accumulation_steps", 1, "derived: completions per optimiser step = per_device_train_batch_size x "
     "gradient_accumulation_steps x ranks"),
    ("average_tokens_across_devices", True, "announce: cohort normalises token-level losses over the whole "
     "update's tokens on every rank (as True does)"),
    ("max_grad_norm", 1.0, "train.max_grad_norm"),
    ("label_smoothing_factor", 0.0, "reject: GRPO has no labels to smooth; leave it at 0"),
    ("bf16", None, "derived: model.dtype (True: bfloat16 weights with fp32 master weights, False: float32, "
     "None: bfloat16 on GPU, float32 on CPU)"),
    ("fp16", False, "reject: cohort trains in bfloat16 or float32; use bf16=True"),
    ("bf16_full_eval", False, "announce: evaluation runs in the training dtype"),
    ("fp16_full_eval", False, "announce: evaluation runs in the training dtype"),
    ("tf32", None, "trainer: sets torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32 when not None"),
    ("activation_checkpointing", None, "derived: model.gradient_checkpointing when not None (the newer name)"),
    ("activation_checkpointing_kwargs", None, "announce: cohort checkpoints every decoder layer (non-reentrant)"),
    ("gradient_checkpointing", True, "model.gradient_checkpointing"),
    ("gradient_checkpointing_kwargs", None, "announce: cohort checkpoints every decoder layer (non-reentrant)"),
    ("torch_compile", False, "model.compile_layers"),
    ("torch_compile_backend", None, "announce: model.compile_layers compiles each decoder layer with inductor"),
    ("torch_compile_mode", None, "announce: model.compile_layers compiles each decoder layer with inductor"),
    ("use_liger_kernel", False, "announce: cohort's chunked logprob kernel already avoids the full "
     "[tokens, vocab] logits (what Liger's fused GRPO loss saves)"),
    ("liger_kernel_config", None, "announce: cohort's chunked logprob kernel replaces Liger's"),
    ("use_cache", False, "announce: the rollout engine keeps its own paged KV cache; training never uses one"),
    ("neftune_noise_alpha", None, "reject: cohort adds no embedding noise (it would change the policy's "
     "logprobs); leave it unset"),
    ("torch_empty_cache_steps", None, "announce: cohort frees memory at fixed points of the step (see "
     "generation.release_kv_during_update)"),
    ("auto_find_batch_size", False, "reject: the generation batch must hold whole groups (TRL rejects it too); "
     "lower per_device_train_batch_size, or let extra={'train.token_budget': n} cap micro-batches"),
    ("logging_strategy", "steps", "derived: 'steps' logs every logging_steps; 'no' keeps only cohort's console "
     "lines and no on_log rows but the closing one; 'epoch' is rejected (use logging_steps)"),
    ("logging_steps", 10, "derived: run.logging_steps in cohort steps; callbacks' on_log and "
     "state.log_history get every logging_steps optimiser steps"),
    ("logging_first_step", False, "announce: cohort logs the first step like every other"),
    ("log_on_each_node", True, f"announce: {_ONE_PROCESS}"),
    ("logging_nan_inf_filter", True, "announce: cohort logs metrics as computed (NaN included)"),
    ("include_num_input_tokens_seen", "no", "announce: cohort always logs num_tokens"),
    ("log_level", "passive", "announce: cohort prints its own lines; configure the 'cohort' logger"),
    ("log_level_replica", "warning", f"announce: {_ONE_PROCESS}"),
    ("disable_tqdm", None, "announce: cohort prints one line per step, no progress bar"),
    ("report_to", "none", "derived: run.report_to (tensorboard, wandb, trackio as named; 'none' keeps "
     "cohort's console lines and metrics.jsonl)"),
    ("run_name", None, "announce: trackers name the run after output_dir"),
    ("project", "huggingface", "announce: trackers use their own default project"),
    ("trackio_space_id", None, "announce: cohort logs to a local trackio run"),
    ("trackio_bucket_id", None, "announce: cohort logs to a local trackio run"),
    ("trackio_static_space_id", None, "announce: cohort logs to a local trackio run"),
    ("eval_strategy", "no", "derived: 'steps' evaluates eval_dataset every eval_steps (run.eval_steps); 'no' "
     "only when you call evaluate(); 'epoch' is rejected (use 'steps')"),
    ("eval_steps", None, "derived: run.eval_steps in cohort steps (None: logging_steps, as TRL)"),
    ("eval_delay", 0, "announce: cohort evaluates from the first eval_steps on"),
    ("per_device_eval_batch_size", 8, f"announce: {_EVAL_LOOP}; every eval prompt gets num_generations_eval "
     "completions"),
    ("prediction_loss_only", False, f"announce: {_EVAL_LOOP}"),
    ("eval_on_start", False, "trainer: evaluate() before the first step"),
    ("eval_do_concat_batches", True, f"announce: {_EVAL_LOOP}"),
    ("eval_use_gather_object", False, f"announce: {_EVAL_LOOP}"),
    ("eval_accumulation_steps", None, f"announce: {_EVAL_LOOP}"),
    ("include_for_metrics", [], f"announce: {_EVAL_LOOP}"),
    ("batch_eval_metrics", False, f"announce: {_EVAL_LOOP}"),
    ("save_only_model", False, "run.save_only_model"),
    ("save_strategy", "steps", "derived: 'steps' saves every save_steps and at the end; 'no' writes no "
     "checkpoint (run.save_at_end=false; save_model() still saves); 'epoch' and 'best' are rejected (use save_steps)"),
    ("save_steps", 500, "derived: run.save_steps in cohort steps (a value below 1 is a fraction of the run)"),
    ("save_on_each_node", False, f"announce: {_ONE_PROCESS}"),
    ("save_total_limit", None, "run.save_total_limit"),
    ("enable_jit_checkpoint", False, "announce: use extra={'run.time_limit_s': s} to stop at a step boundary "
     "with a checkpoint"),
    ("push_to_hub", False, "trainer: True calls push_to_hub() at the end of train(), as TRL"),
    ("hub_token", None, "trainer: used by push_to_hub()"),
    ("hub_private_repo", None, "trainer: used by push_to_hub()"),
    ("hub_model_id", None, "trainer: used by push_to_hub()"),
    ("hub_strategy", "every_save", "trainer: push_to_hub() uploads the final model; checkpoints stay local"),
    ("hub_always_push", False, "trainer: push_to_hub() uploads the final model; checkpoints stay local"),
    ("hub_revision", None, "trainer: used by push_to_hub()"),
    ("load_best_model_at_end", False, "reject: cohort keeps the last model; pick a checkpoint from "
     "output_dir/checkpoints with evaluate()"),
    ("metric_for_best_model", None, "announce: only used with load_best_model_at_end, which cohort rejects"),
    ("greater_is_better", None, "announce: only used with load_best_model_at_end, which cohort rejects"),
    ("ignore_data_skip", False, "announce: a resumed run restores the prompt sampler's position exactly"),
    ("restore_callback_states_from_checkpoint", False, "announce: callbacks are not checkpointed"),
    ("full_determinism", False, "announce: cohort seeds every step's sampling from (seed, step)"),
    ("seed", 42, "train.seed"),
    ("data_seed", None, "announce: the prompt order is seeded by seed"),
    ("use_cpu", False, "derived: train.device='cpu' when True"),
    ("accelerator_config", None, f"announce: {_ONE_PROCESS}"),
    ("parallelism_config", None, "announce: cohort shards with extra={'train.sharding': 'fsdp'}"),
    ("dataloader_drop_last", False, f"announce: {_DATALOADER}"),
    ("dataloader_num_workers", 0, f"announce: {_DATALOADER}"),
    ("dataloader_pin_memory", True, f"announce: {_DATALOADER}"),
    ("dataloader_persistent_workers", False, f"announce: {_DATALOADER}"),
    ("dataloader_prefetch_factor", None, f"announce: {_DATALOADER}"),
    ("dataloader_multiprocessing_context", None, f"announce: {_DATALOADER}"),
    ("dataloader_in_order", True, f"announce: {_DATALOADER}"),
    ("remove_unused_columns", False, "announce: reward functions always receive every dataset column"),
    ("label_names", None, "announce: GRPO has no labels"),
    ("train_sampling_strategy", "random", "reject: cohort draws prompts in a seeded random order (TRL's "
     "'random'); order the rows yourself and set shuffle_dataset=False for a fixed order"),
    ("length_column_name", "length", "announce: GRPO has no length-grouped sampler"),
    ("ddp_find_unused_parameters", None, f"announce: {_ONE_PROCESS}; gradients are summed by cohort's reducer"),
    ("ddp_bucket_cap_mb", None, f"announce: {_ONE_PROCESS}; gradients are summed by cohort's reducer"),
    ("ddp_broadcast_buffers", None, f"announce: {_ONE_PROCESS}; gradients are summed by cohort's reducer"),
    ("ddp_static_graph", None, f"announce: {_ONE_PROCESS}; gradients are summed by cohort's reducer"),
    ("ddp_backend", None, f"announce: {_ONE_PROCESS}; NCCL on CUDA, gloo on CPU"),
    ("ddp_timeout", 1800, "train.dist_timeout_s"),
    ("fsdp", None, "derived: train.sharding='fsdp' when set (FSDP2, one unit per decoder layer)"),
    ("fsdp_config", None, "announce: cohort's FSDP2 wraps each decoder layer; see train.fsdp_* in extra"),
    ("deepspeed", None, "announce: cohort shards with FSDP2 (extra={'train.sharding': 'fsdp'}), not DeepSpeed"),
    ("debug", "", "announce: no debug hooks"),
    ("skip_memory_metrics", True, "announce: cohort logs memory/* when on CUDA"),
    ("do_train", False, "announce: your script decides what to run, as with TRL"),
    ("do_eval", False, "announce: your script decides what to run, as with TRL"),
    ("do_predict", False, "announce: your script decides what to run, as with TRL"),
    ("resume_from_checkpoint", None, "announce: as in TRL, pass it to trainer.train(resume_from_checkpoint=...)"),
    ("local_rank", -1, f"announce: {_ONE_PROCESS}"),
    # ---- GRPOConfig's own fields
    ("model_init_kwargs", None, "trainer: dtype/torch_dtype -> model.dtype, attn_implementation -> "
     "model.attn_implementation, trust_remote_code, quantization_config (a 4-bit BitsAndBytesConfig: the named "
     "model loads in 4 bits, QLoRA with peft_config); other keys are rejected by name"),
    ("trust_remote_code", False, "model.trust_remote_code"),
    ("router_aux_loss_coef", None, "derived: loss.router_aux_loss_coef (None: the model config's own coefficient, "
     "0.0: off; logged as aux_loss)"),
    ("disable_dropout", False, "trainer: sets every dropout probability of the policy to 0"),
    ("cast_lm_head_to_fp32", False, "announce: cohort's logprob kernel computes log-softmax in float32 "
     "(and the LM-head gradient in float32 with master weights)"),
    ("num_generations", 8, "generation.num_generations"),
    ("num_generations_eval", None, "derived: run.eval_num_samples (None: greedy, one per prompt)"),
    ("max_completion_length", 512, "generation.max_completion_length"),
    ("ds3_gather_for_generation", True, "announce: with FSDP the engine reads gathered bf16 weights"),
    ("shuffle_dataset", True, "data.shuffle"),
    ("pad_to_multiple_of", "auto", "announce: cohort packs sequences without padding"),
    ("generation_batch_size", None, "derived: train.prompts_per_step = generation_batch_size / num_generations"),
    ("steps_per_generation", None, "derived: train.mini_batches = steps_per_generation / "
     "gradient_accumulation_steps"),
    ("temperature", 1.0, "generation.temperature"),
    ("top_p", 1.0, "generation.top_p"),
    ("top_k", 0, "generation.top_k"),
    ("min_p", None, "derived: generation.min_p (None: 0, off)"),
    ("generation_kwargs", None, "derived: stop_strings, max_new_tokens, temperature, top_p, top_k, min_p, "
     "repetition_penalty, ignore_eos map to generation.*; do_sample=False is temperature 0, num_beams=1 is "
     "accepted; other GenerationConfig options (num_beams > 1, length_penalty, ...) go to "
     "generation.hf_generate_kwargs and transformers' generate samples (generation.engine=hf), announced"),
    ("chat_template_kwargs", None, "trainer: passed to tokenizer.apply_chat_template for every prompt"),
    ("repetition_penalty", 1.0, "generation.repetition_penalty"),
    ("cache_implementation", None, "announce: the rollout engine keeps its own paged KV cache"),
    ("use_vllm", False, "derived: with vllm_mode='server', generation.placement=server (sampling on a `cohort "
     "serve` process, weights pushed after every step; docs/serving.md); otherwise cohort's in-process engine"),
    ("vllm_mode", "colocate", "derived: 'server' (with use_vllm) -> generation.placement=server; 'colocate': "
     "cohort's engine in each trainer process, reading the weights in place"),
    ("vllm_model_impl", "vllm", f"announce: {_VLLM}"),
    ("vllm_enable_sleep_mode", False, "generation.release_kv_during_update"),
    ("vllm_structured_outputs_regex", None, "reject: cohort's engine has no constrained decoding; score the "
     "format with a reward function instead"),
    ("vllm_server_base_url", None, "derived: generation.server_address (the URL's host:port); wins over "
     "vllm_server_host/port, as in TRL"),
    ("vllm_server_host", "0.0.0.0", "derived: generation.server_address's host (0.0.0.0: this machine)"),
    ("vllm_server_port", 8000, "derived: generation.server_address's port"),
    ("vllm_server_timeout", 240.0, "generation.server_connect_timeout_s"),
    ("vllm_group_port", 51216, "announce: `cohort serve` opens the weight group on a free port it announces to "
     "the trainer (docs/serving.md)"),
    ("vllm_gpu_memory_utilization", 0.3, "announce: the engine's KV cache takes extra={'generation."
     "kv_cache_fraction': f} of the free memory, lowered automatically so the update fits"),
    ("vllm_max_model_length", None, "generation.max_model_len"),
    ("vllm_tensor_parallel_size", 1, f"announce: {_VLLM}; it runs on each rank's GPU"),
    ("beta", 0.0, "loss.beta"),
    ("num_iterations", 1, "train.num_iterations"),
    ("epsilon", 0.2, "loss.epsilon"),
    ("delta", None, "loss.delta"),
    ("epsilon_high", None, "loss.epsilon_high"),
    ("sapo_temperature_neg", 1.05, "loss.sapo_temperature_neg"),
    ("sapo_temperature_pos", 1.0, "loss.sapo_temperature_pos"),
    ("vespo_k_pos", 2.0, "loss.vespo_k_pos"),
    ("vespo_lambda_pos", 3.0, "loss.vespo_lambda_pos"),
    ("vespo_k_neg", 3.0, "loss.vespo_k_neg"),
    ("vespo_lambda_neg", 2.0, "loss.vespo_lambda_neg"),
    ("importance_sampling_level", "token", "loss.importance_sampling_level"),
    ("reward_weights", None, "reward.reward_weights"),
    ("multi_objective_aggregation", "sum_then_normalize", "advantage.multi_objective_aggregation"),
    ("scale_rewards", "group", "derived: advantage.scale_rewards (True: 'group', False: 'none')"),
    ("loss_type", "dapo", "loss.loss_type"),
    ("mask_truncated_completions", False, "generation.mask_truncated_completions"),
    ("sync_ref_model", False, "trainer: TR-DPO's reference sync: after every ref_model_sync_steps optimiser "
     "steps the reference becomes ref_model_mixup_alpha x policy + (1 - alpha) x reference (needs beta != 0, no PEFT)"),
    ("ref_model_mixup_alpha", 0.6, "trainer: the policy's share in each sync_ref_model update"),
    ("ref_model_sync_steps", 512, "trainer: optimiser steps between sync_ref_model updates"),
    ("top_entropy_quantile", 1.0, "loss.top_entropy_quantile"),
    ("entropy_coef", 0.0, "loss.entropy_coef"),
    ("use_adaptive_entropy", False, "trainer: Skywork-OR1's adaptive entropy: after each optimiser step "
     "entropy_coef moves by entropy_coef_delta towards entropy_target (up while the step's entropy is at or below "
     "it), within [entropy_coef_min, entropy_coef_max], and the bonus acts only while the last entropy was at or "
     "below the target"),
    ("entropy_coef_min", 0.0, "trainer: the lower bound of the adaptive entropy_coef"),
    ("entropy_coef_max", 1.0, "trainer: the upper bound of the adaptive entropy_coef"),
    ("entropy_coef_delta", 0.005, "trainer: the adaptive entropy_coef's change per optimiser step"),
    ("entropy_target", 0.2, "trainer: the token entropy the adaptive entropy_coef steers towards"),
    ("max_tool_calling_iterations", None, "generation.max_tool_calling_iterations"),
    ("vllm_importance_sampling_correction", True, "loss.sampler_is_correction"),
    ("vllm_importance_sampling_mode", "sequence_mask", "derived: loss.sampler_is_mode (vespo keeps its "
     "token-level default, as TRL requires for it)"),
    ("vllm_importance_sampling_clip_max", 3.0, "loss.sampler_is_clip_max"),
    ("vllm_importance_sampling_clip_min", None, "loss.sampler_is_clip_min"),
    ("off_policy_mask_threshold", None, "loss.off_policy_mask_threshold"),
    ("use_bias_correction_kl", True, "loss.use_bias_correction_kl"),
    ("log_completions", False, "run.log_completions"),
    ("log_multimodal", True, "announce: cohort logs text completions only"),
    ("num_completions_to_print", None, "announce: completions go to output_dir/samples.jsonl, none printed"),
    ("log_unique_prompts", False, "announce: completions go to output_dir/samples.jsonl, one row each"),
    ("log_completions_hub_repo", None, "reject: completions are written to output_dir/samples.jsonl; upload "
     "that file yourself"),
    ("use_transformers_continuous_batching", False, "announce: cohort's engine batches continuously already"),
    ("transformers_continuous_batching_config", None, "announce: cohort's engine batches continuously already"),
    ("use_transformers_paged", False, "announce: cohort's engine has a paged KV cache already"),
    ("vllm_importance_sampling_cap", None, "derived: the deprecated name of vllm_importance_sampling_clip_max"),
]

# cohort's own additions to TRL's fields (not in TRL 1.16's GRPOConfig)
EXTRA_FIELDS: list[tuple[str, Any, str]] = [
    ("max_prompt_length", None, "derived: data.max_prompt_length, keeping the end of longer prompts "
     "(None: no truncation, as TRL 1.16)"),
    ("warmup_ratio", None, "derived: transformers < 5's name; warmup_steps = ceil(ratio x optimiser steps)"),
    ("extra", {}, "derived: any cohort dotted key, e.g. {'train.token_budget': 8192}, applied last"),
]

TABLE: dict[str, tuple[Any, str]] = {name: (default, status) for name, default, status in FIELDS + EXTRA_FIELDS}


def kind(status: str) -> str:
    """mapped | derived | trainer | announce | reject."""
    head = status.split(":", 1)[0]
    return head if head in ("derived", "trainer", "announce", "reject") else "mapped"


def markdown_table() -> str:
    """The docs table (docs/trl_compat.md embeds exactly this; a test keeps them equal)."""
    rows = ["| field | TRL 1.16 default | status | cohort |", "|---|---|---|---|"]
    for name, default, status in FIELDS + EXTRA_FIELDS:
        k = kind(status)
        text = status if k == "mapped" else status.split(":", 1)[1].strip()
        if k == "mapped":
            text = f"`{text}`"
        text = text.replace("|", "\\|")
        rows.append(f"| `{name}` | `{default!r}` | {k} | {text} |")
    return "\n".join(rows)


BEGIN, END = "<!-- fields:begin (generated: python -m cohort.trl_compat.fields docs/trl_compat.md) -->", \
    "<!-- fields:end -->"


def write_doc(path: str) -> None:
    """Replace the table between the markers of `path` with `markdown_table()`."""
    doc = Path(path).read_text()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(path).write_text(f"{head}{BEGIN}\n{markdown_table()}\n{END}{tail}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        write_doc(sys.argv[1])
    else:
        print(markdown_table())

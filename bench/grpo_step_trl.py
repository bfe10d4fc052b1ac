"""The TRL side of bench/grpo_step.py: GRPOTrainer on the benchmark's workload, timed per phase.

TRL has no per-phase timers, so its methods are wrapped on the trainer instance (each call synchronised
with the GPU): `_generate` (tokenise + HF generate), `_calculate_rewards` (score), no-grad
`_get_per_token_logps_and_entropies` (logprobs), `_prepare_inputs` (the whole experience half); a callback
gives each optimizer step's wall time, and update = step - prepare.

Two settings (`trl_settings`), both with what the workload fixes (256 completions per optimizer step,
lengths, beta = 0, bf16, no saving or reporting):
- `trl`: TRL's defaults: 8 completions per micro-batch (so 32 accumulation steps), gradient checkpointing on.
- `trl-tuned`: what a TRL user with a big GPU would set: 32 completions per micro-batch (8 accumulation
  steps), gradient checkpointing off. Measured on one H200 (issue 16) this was TRL's fastest setting: 6.22 s
  per step on 0.5B against 10.62 s for the defaults; `cache_implementation="static"` (8.26 s) and
  `use_transformers_continuous_batching=True` (35.9 s) were slower, so the row sets them off explicitly.
In both, one generation batch is the whole step (TRL's steps_per_generation = gradient_accumulation_steps).
"""

from __future__ import annotations

import tempfile
import time

import torch
from grpo_step import (
    TRL_TUNED_MICRO,
    build_model,
    build_tokenizer,
    length_reward,
    make_prompts,
    peak_memory,
    sync,
)

TRL_DEFAULT_MICRO = 8  # GRPOConfig's default per_device_train_batch_size


def trl_batch_shape(completions: int, micro_target: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) that together hold exactly `completions`
    per optimizer step: the micro-batch is `micro_target`, or all completions when there are fewer."""
    if completions < 1 or micro_target < 1:
        raise ValueError(f"completions ({completions}) and micro-batch ({micro_target}) must be >= 1")
    micro = min(micro_target, completions)
    if completions % micro:
        raise ValueError(f"{completions} completions per step (--prompts x --generations) do not split into "
                         f"micro-batches of {micro}: TRL would train on {completions // micro * micro} of them; "
                         f"choose --prompts x --generations a multiple of {micro} (or --trl-tuned-micro)")
    return micro, completions // micro


def trl_settings(tuned: bool, completions: int, tuned_micro: int = TRL_TUNED_MICRO, tuned_gc: bool = False) -> dict:
    """The GRPOConfig fields in which the two TRL rows differ. The defaults row passes only the batch shape
    (so gradient checkpointing, the cache and the generation backend are TRL's own defaults). tuned_gc: the
    tuned row with gradient checkpointing on (bench/long.py, where no micro-batch fits without it)."""
    micro, accum = trl_batch_shape(completions, tuned_micro if tuned else TRL_DEFAULT_MICRO)
    settings = {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum}
    if tuned:
        # off explicitly: both were slower than the dynamic cache on an H200 (issue 16: 8.26 s and 35.9 s
        # against 6.22 s per step), and a later TRL default should not change what this row measures
        settings.update(gradient_checkpointing=tuned_gc, cache_implementation=None,
                        use_transformers_continuous_batching=False)
    return settings


def _trl_trainer(args, model, tok, device, tuned: bool = False):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n = args.prompts * args.generations
    cuda = device.type == "cuda"
    targs = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_step_trl_"), num_generations=args.generations,
        max_completion_length=args.completion_len, temperature=1.0, learning_rate=1e-6, beta=0.0,
        max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none",
        generation_kwargs={"min_new_tokens": args.completion_len}, seed=0, bf16=cuda, use_cpu=not cuda,
        disable_tqdm=True,
        **trl_settings(tuned, n, getattr(args, "trl_tuned_micro", TRL_TUNED_MICRO), getattr(args, "trl_tuned_gc", False)),
    )
    rows = make_prompts(args.prompts * targs.max_steps, args.prompt_len, model.config.vocab_size)
    return GRPOTrainer(model=model, reward_funcs=[length_reward], args=targs,
                       train_dataset=Dataset.from_dict({"prompt": rows}), processing_class=tok)


def _instrument_trl(trainer, device) -> list[dict]:
    """Per-step phase seconds from wrapped TRL methods (synchronised), plus step time from a callback."""
    from transformers import TrainerCallback

    steps: list[dict] = []
    current: dict = {}

    def timed(name, fn, only_no_grad=False):
        def wrapper(*a, **k):
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **k)
            sync(device)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                sync(device)
                current[name] = current.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("score", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed(
        "logprobs", trainer._get_per_token_logps_and_entropies, only_no_grad=True)
    trainer._prepare_inputs = timed("prepare", trainer._prepare_inputs)

    class StepClock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync(device)
            current.clear()
            current["_start"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            sync(device)
            steps.append({**current, "step": time.perf_counter() - current.pop("_start")})

    trainer.add_callback(StepClock())
    return steps


def run_trl(args, tuned: bool = False) -> dict:
    device = torch.device(args.device)
    model = build_model(args.size, device)
    tok = build_tokenizer(model.config.vocab_size)
    trainer = _trl_trainer(args, model, tok, device, tuned)
    raw = _instrument_trl(trainer, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    steps = []
    for s, log in zip(raw, logs):
        phases = {k: s.get(k, 0.0) for k in ("generate", "score", "logprobs")}
        phases["update"] = s["step"] - s.get("prepare", 0.0)
        steps.append({**phases, "step": s["step"], "other": s["step"] - sum(phases.values()),
                      "completion_len": log["completions/mean_length"], "num_tokens": log.get("num_tokens")})
    import trl
    return {"steps": steps, "num_params": sum(p.numel() for p in model.parameters()),
            "trl_version": trl.__version__, "micro_batch": trainer.args.per_device_train_batch_size,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "steps_per_generation": trainer.args.steps_per_generation,
            "cache_implementation": trainer.args.cache_implementation,
            "continuous_batching": bool(trainer.args.use_transformers_continuous_batching),
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            # what the model did, not only what was asked (transformers 5 renames the field activation_checkpointing)
            "model_gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            **peak_memory(device)}

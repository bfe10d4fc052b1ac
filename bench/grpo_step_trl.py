"""The TRL side of bench/grpo_step.py: GRPOTrainer on the benchmark's workload, timed per phase.

TRL has no per-phase timers, so its methods are wrapped on the trainer instance (each call synchronised
with the GPU): `_generate` (tokenise + HF generate), `_calculate_rewards` (score), no-grad
`_get_per_token_logps_and_entropies` (logprobs), `_prepare_inputs` (the whole experience half); a callback
gives each optimizer step's wall time, and update = step - prepare. Settings are TRL's defaults except
what the workload fixes (batch shape, lengths, beta = 0, bf16, no saving or reporting).
"""

from __future__ import annotations

import tempfile
import time

import torch
from grpo_step import build_model, build_tokenizer, length_reward, make_prompts, peak_memory, sync


def _trl_trainer(args, model, tok, device):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n = args.prompts * args.generations
    micro = min(8, n)  # GRPOConfig's default per_device_train_batch_size
    cuda = device.type == "cuda"
    targs = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_step_trl_"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro, num_generations=args.generations,
        max_completion_length=args.completion_len, temperature=1.0, learning_rate=1e-6, beta=0.0,
        max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none",
        generation_kwargs={"min_new_tokens": args.completion_len}, seed=0, bf16=cuda, use_cpu=not cuda,
        disable_tqdm=True,
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


def run_trl(args) -> dict:
    device = torch.device(args.device)
    model = build_model(args.size, device)
    tok = build_tokenizer(model.config.vocab_size)
    trainer = _trl_trainer(args, model, tok, device)
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
            "gradient_checkpointing": bool(trainer.args.gradient_checkpointing), **peak_memory(device)}

"""The TRL row of bench/scale.py: GRPOTrainer on grpo_step.py's workload, sharded with FSDP2 through
`accelerate launch`, one process per GPU.

The parent (bench/scale.py) writes an accelerate config (JSON, which `accelerate launch --config_file` reads
like YAML): distributed_type FSDP, fsdp_version 2, TRANSFORMER_BASED_WRAP of Qwen2DecoderLayer (one unit per
decoder layer plus the root), reshard after forward, no CPU-RAM-efficient loading (the model is built on each
rank's GPU, not loaded), no activation checkpointing, mixed precision bf16 (accelerate then upcasts the bf16
parameters to fp32 masters, so the Adam state is fp32 as in cohort's rows), num_processes N. It launches

    python -m accelerate.commands.launch --config_file <that file> --num_processes N --main_process_port P \\
        bench/scale_trl.py --json-dir DIR --size 1.5b ...

Each rank builds the random-weight model (grpo_step.build_model) on its GPU and trains on the same per-GPU
workload as cohort's rows: 32 prompts x 8 completions per GPU per step (per_device_train_batch_size 32,
gradient_accumulation_steps 8: one optimizer step per GRPO step; the generation batch is the 256 completions
of those 8 micro-batches, generated at once), completions of exactly 256 tokens (min_new_tokens), beta 0,
no gradient checkpointing, HF generate (each decoding step all-gathers the sharded layers). Phases are timed
by grpo_step_trl's wrappers; every rank writes rankR.json (its peak memory), rank 0 also the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402


def accelerate_config(num_processes: int, device: str) -> dict:
    cuda = device == "cuda"
    return {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "FSDP",
        "downcast_bf16": "no", "enable_cpu_affinity": False,
        "fsdp_config": {
            "fsdp_activation_checkpointing": False, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer", "fsdp_cpu_ram_efficient_loading": False,
            "fsdp_offload_params": False, "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_version": 2,
        },
        "machine_rank": 0, "main_training_function": "main", "mixed_precision": "bf16" if cuda else "no",
        "num_machines": 1, "num_processes": num_processes, "rdzv_backend": "static", "same_network": True,
        "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": not cuda,
    }


def launch_command(args, num_processes: int, json_dir: str, workload: list[str], port: int) -> list[str]:
    """The `accelerate launch` command of the TRL row (writes its config into json_dir)."""
    config = os.path.join(json_dir, "accelerate_fsdp2.json")
    with open(config, "w") as fh:
        json.dump(accelerate_config(num_processes, args.device), fh, indent=1)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config,
            "--num_processes", str(num_processes), "--main_process_port", str(port),
            os.path.join(HERE, "scale_trl.py"), "--json-dir", json_dir, "--size", args.sizes.split(",")[0],
            "--micro-batch", str(args.trl_micro_batch), *workload]


def _trainer(args, model, tok, world: int):
    from datasets import Dataset
    from grpo_step import length_reward, make_prompts
    from trl import GRPOConfig, GRPOTrainer

    n = args.prompts * args.generations  # completions per GPU per step
    micro = min(args.micro_batch, n)
    cuda = args.device == "cuda"
    extra = {}
    if "activation_checkpointing" in GRPOConfig.__dataclass_fields__:  # transformers >= 5.2x's name
        extra["activation_checkpointing"] = args.gradient_checkpointing
    targs = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="scale_trl_"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro, gradient_checkpointing=args.gradient_checkpointing,
        num_generations=args.generations, max_completion_length=args.completion_len, temperature=1.0,
        learning_rate=1e-6, beta=0.0, max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no",
        report_to="none", generation_kwargs={"min_new_tokens": args.completion_len}, seed=0, bf16=cuda,
        use_cpu=not cuda, disable_tqdm=True, **extra,
    )
    rows = make_prompts(args.prompts * world * targs.max_steps, args.prompt_len, model.config.vocab_size)
    return GRPOTrainer(model=model, reward_funcs=[length_reward], args=targs,
                       train_dataset=Dataset.from_dict({"prompt": rows}), processing_class=tok)


def _steps(args, raw: list[dict], logs: list[dict], world: int) -> list[dict]:
    workload = args.prompts * args.generations * (args.prompt_len + args.completion_len) * world
    steps, before = [], 0
    for i, s in enumerate(raw):
        log = logs[i] if i < len(logs) else {}
        seen = log.get("num_tokens")
        tokens = seen - before if seen is not None else workload
        before = seen if seen is not None else before
        steps.append({"step": s["step"], "generate": s.get("generate", 0.0), "score": s.get("score", 0.0),
                      "logprobs": s.get("logprobs", 0.0), "update": s["step"] - s.get("prepare", 0.0),
                      "weight_gather": None, "tokens": tokens, "workload_tokens": workload,
                      "completion_len": log.get("completions/mean_length")})
    return steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json-dir", required=True)
    p.add_argument("--size", default="1.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32, help="per GPU")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    args = p.parse_args(argv)

    from grpo_step import build_model, build_tokenizer, peak_memory
    from grpo_step_trl import _instrument_trl

    local, world = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(args.size, device)
    num_params = sum(p.numel() for p in model.parameters())
    tok = build_tokenizer(model.config.vocab_size)
    trainer = _trainer(args, model, tok, world)
    raw = _instrument_trl(trainer, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    rank = trainer.accelerator.process_index
    peaks = peak_memory(device) if device.type == "cuda" else {"peak_alloc_gib": None, "peak_reserved_gib": None}
    out = {"rank": rank, "world": world, **peaks}
    if trainer.accelerator.is_main_process:
        import trl

        logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
        out.update(steps=_steps(args, raw, logs, world), num_params=num_params, trl_version=trl.__version__,
                   micro_batch=trainer.args.per_device_train_batch_size,
                   gradient_accumulation_steps=trainer.args.gradient_accumulation_steps,
                   gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
                   distributed_type=str(trainer.accelerator.distributed_type),
                   fsdp_version=getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "fsdp_version", None))
    with open(os.path.join(args.json_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh, default=str)


if __name__ == "__main__":
    main()

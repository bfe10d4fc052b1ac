r"""QLoRA against LoRA on bf16 weights: one GRPO step's seconds and peak memory, each row in its own process, one run.

    python3 bench/qlora.py                          # 0.5B: lora, lora-merged, qlora (merged bf16 copy), qlora-4bit
    python3 bench/qlora.py --size 1.5b --steps 3
    python3 bench/qlora.py --release-kv             # every row with generation.release_kv_during_update=true
    python3 bench/qlora.py --size tiny --rows lora --prompts 4 --generations 4 --prompt-len 16 \
        --completion-len 16                         # CPU smoke test (the QLoRA rows need CUDA and are refused)

On one GPU, bitsandbytes carried from the ignored .whl/ folder (docs/training.md, "QLoRA"):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl && \
    PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 python3 bench/qlora.py --out $OUT/qlora.json --log $OUT/qlora.log

Workload (bench/grpo_step.py's, smaller by default): the Qwen2.5 architecture (0.5B, 1.5B or tiny) with random
weights, saved once as a bf16 model folder with grpo_step's word-level tokenizer; each step --prompts prompts x
--generations completions, prompts of exactly --prompt-len tokens, completions of exactly --completion-len tokens
(generation.ignore_eos), temperature 1, grpo_step's length reward, one optimizer update per step, beta = 0,
on-policy. Every row trains LoRA adapters of rank --lora-r (alpha 2r) on all seven projections of every layer,
with cohort's defaults otherwise (no gradient checkpointing unless --gradient-checkpointing, fp32 adapters and
Adam moments).

Rows: `lora` (the base in bf16, the engine running the adapters unmerged on it in place), `lora-merged` (the same,
the engine on a copy of the adapted layers with the adapters merged: generation.lora_engine=merged), `qlora`
(model.quantization=nf4: the base in 4 bits, the engine on a merged bf16 copy refreshed after each step:
generation.quantized_engine=merged_bf16, the default), `qlora-4bit` (the same base, the engine on the trainer's
4-bit layers and adapters in place: generation.quantized_engine=4bit). Each row loads the folder with cohort's
loader (cohort.policy.model.load_policy), sizes the KV pool to 1.25 x the workload's KV (the same bytes in every
row), and hands the model to build_components.

Measured per row: seconds per step (mean over the steps after --warmup) and its phases (generate without scoring,
score, update, sync_weights: the merged copy's refresh), GPU memory allocated after loading and after set-up
(weights, merged copy, KV pool), the peak over the training steps and the peaks of the generate and update phases
(torch.cuda.max_memory_allocated, as grpo_step's rows), the engine's name, and the train/inference mismatch the
trainer logs (sampling/sampling_logp_difference/mean). The JSON holds every step; bench/manifest.py writes the
manifest beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s helpers, also when imported by path
from grpo_step import (
    SIZES,
    TimedRewards,
    _PhasePeaks,
    build_model,
    build_tokenizer,
    kv_bytes_per_token,
    length_reward,
    prompt_rows,
)
from manifest import record_run

# row -> (model.quantization, generation.quantized_engine)
ROWS = {"lora": ("none", "merged_bf16"), "lora-merged": ("none", "merged_bf16"), "qlora": ("nf4", "merged_bf16"),
        "qlora-4bit": ("nf4", "4bit")}
GIB = 2**30


# ---------------------------------------------------------------------------------------------------------
# Child: one row


def save_model_folder(size: str, folder: str) -> str:
    """The size's random Qwen2 model (seeded), saved as a bf16 model folder (with a tokenizer the loader reads; each
    row then uses grpo_step's word-level one, which AutoTokenizer would reload as Qwen2's)."""
    model = build_model(size, torch.device("cpu")).to(torch.bfloat16)
    model.save_pretrained(folder)
    build_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def row_config(args, row: str, kv_fraction: float):
    """The trainer's config of a row: only model.quantization, generation.quantized_engine and
    generation.lora_engine differ."""
    from cohort.config import CohortConfig

    cfg = CohortConfig()
    m, g, t = cfg.model, cfg.generation, cfg.train
    m.name_or_path, (m.quantization, g.quantized_engine) = args.folder, ROWS[row]
    g.lora_engine = "merged" if row == "lora-merged" else "adapters"
    m.lora_r, m.lora_alpha, m.gradient_checkpointing = args.lora_r, 2 * args.lora_r, args.gradient_checkpointing
    g.num_generations, g.max_completion_length, g.temperature = args.generations, args.completion_len, 1.0
    g.ignore_eos, g.engine, g.kv_cache_fraction = True, "cohort", kv_fraction
    g.release_kv_during_update = args.release_kv
    cfg.data.source, cfg.data.max_prompt_length = prompt_rows, args.prompt_len  # the rows are handed in
    t.prompts_per_step, t.mini_batches, t.num_iterations = args.prompts, 1, 1
    t.max_steps, t.seed, t.device = args.warmup + args.steps, 0, args.device
    cfg.loss.beta = 0.0
    cfg.run.output_dir = tempfile.mkdtemp(prefix="qlora_bench_")
    cfg.run.overwrite, cfg.run.report_to = True, ["jsonl"]
    return cfg


def kv_fraction_for(args, model, quantization: str, engine: str) -> tuple[float, float]:
    """(generation.kv_cache_fraction, the pool in GiB): 1.25 x the workload's KV (at least one max-length
    sequence) as a share of what will be free when the engine sizes its pool (after a merged copy, if any)."""
    from cohort.policy.quantized import copy_bytes

    need = args.prompts * args.generations * (args.prompt_len + args.completion_len) * kv_bytes_per_token(model)
    kv = max(1.25 * need, 1.1 * 4096 * kv_bytes_per_token(model))
    if args.device != "cuda":
        return 0.3, kv / GIB
    free = torch.cuda.mem_get_info()[0] - (copy_bytes(model) if quantization != "none" and engine == "merged_bf16" else 0)
    return min(1.0, kv / free), kv / GIB


def run_row(args, row: str) -> dict:
    import cohort.trainer
    from cohort.data.dataset import PromptDataset
    from cohort.policy.model import load_policy
    from cohort.rewards import RewardRunner

    device = torch.device(args.device)
    quantization, engine = ROWS[row]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = load_policy(args.folder, dtype=dtype, device=device, quantization=quantization)
    tok = build_tokenizer(model.config.vocab_size)
    loaded = torch.cuda.memory_allocated() / GIB if device.type == "cuda" else float("nan")
    kv_fraction, kv_gib = kv_fraction_for(args, model, quantization, engine)
    cfg = row_config(args, row, kv_fraction)
    rows = prompt_rows(args.prompts * cfg.train.max_steps, args.prompt_len, model.config.vocab_size)
    data = PromptDataset(rows, "bench").encode(tok, args.prompt_len)
    rewards = TimedRewards(RewardRunner([length_reward]))
    with mock.patch.object(cohort.trainer, "_save", lambda *a, **k: None):  # no checkpoint
        comp = cohort.trainer.build_components(cfg, policy=model, tokenizer=tok, reward_runner=rewards,
                                               train_data=data, echo=print)
        after_setup = torch.cuda.memory_allocated() / GIB if device.type == "cuda" else float("nan")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        peaks = _PhasePeaks(device)
        with ExitStack() as stack:
            stack.enter_context(peaks.watching(comp))
            result = cohort.trainer.train(cfg, comp, echo=print)
    steps = []
    for m, score in zip(result.history, rewards.seconds):
        steps.append({"step": m["step_time"], "generate": m["time/generate"] - score, "score": score,
                      "update": m["time/update"], "sync_weights": m.get("time/sync_weights", 0.0),
                      "mismatch": m.get("sampling/sampling_logp_difference/mean", float("nan"))})
    return {"steps": steps, "engine": comp.engine.engine_name(), "loaded_gib": loaded, "after_setup_gib": after_setup,
            "kv_planned_gib": kv_gib, "phase_peak_alloc_gib": peaks.peaks, **peaks.overall(),
            "trainable_params": sum(p.numel() for p in comp.policy.parameters() if p.requires_grad),
            "merged_copy_gib": getattr(getattr(comp.engine, "merged", None), "bytes", 0) / GIB,
            "graph_recaptures": getattr(getattr(comp.engine, "runner", None), "graph_recaptures", None)}


# ---------------------------------------------------------------------------------------------------------
# Parent: the rows one after another, the table


def summarise(args, result: dict) -> dict:
    steady = result["steps"][args.warmup:] or result["steps"]
    keys = ("step", "generate", "score", "update", "sync_weights", "mismatch")
    mean = {k: sum(s[k] for s in steady) / len(steady) for k in keys}
    mean["gen_tok_s"] = args.prompts * args.generations * args.completion_len / mean["generate"]
    mean["measured_steps"] = len(steady)
    return mean


def run_child(args, row: str) -> dict:
    out = tempfile.mktemp(suffix=".json")
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
             ("size", "device", "warmup", "steps", "prompts", "generations", "prompt_len", "completion_len", "lora_r")]
    cmd = [sys.executable, os.path.abspath(__file__), "--child", row, "--folder", args.folder, "--json", out, *flags]
    cmd += ["--release-kv" if args.release_kv else "--no-release-kv",
            "--gradient-checkpointing" if args.gradient_checkpointing else "--no-gradient-checkpointing"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout_s)
        log, ok = proc.stdout + proc.stderr, proc.returncode == 0 and os.path.exists(out)
    except subprocess.TimeoutExpired as exc:
        log, ok = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {args.child_timeout_s:.0f} s", False
    wall = time.perf_counter() - start
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(f"\n===== {args.size} {row} ({wall:.0f} s) =====\n{log}")
    if not ok:
        tail = "\n".join(log.strip().splitlines()[-15:])
        print(f"[{row}] FAILED after {wall:.0f} s:\n{tail}", flush=True)
        return {"error": tail.splitlines()[-1] if tail else "failed", "wall_s": wall}
    with open(out) as fh:
        result = json.load(fh)
    result.update(wall_s=wall, summary=summarise(args, result))
    print(f"[{row}] {wall:.0f} s wall: {json.dumps(result['summary'])} {result['engine']}", flush=True)
    return result


def table(args, results: dict) -> str:
    lines = [f"QLoRA vs LoRA, {args.size}, {args.prompts} x {args.generations} completions of {args.completion_len} "
             f"tokens, LoRA r={args.lora_r}{', KV released during the update' if args.release_kv else ''}",
             "| row | s/step | generate s | update s | sync s | gen tok/s | loaded GiB | after set-up GiB | "
             "peak GiB (generate / update) | mismatch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row, r in results.items():
        if "summary" not in r:
            lines.append(f"| {row} | failed: {r.get('error', '?')} |" + " |" * 8)
            continue
        s, p = r["summary"], r["phase_peak_alloc_gib"]
        lines.append(f"| {row} | {s['step']:.3f} | {s['generate']:.3f} | {s['update']:.3f} | {s['sync_weights']:.4f} | "
                     f"{s['gen_tok_s']:.0f} | {r['loaded_gib']:.2f} | {r['after_setup_gib']:.2f} | "
                     f"{r['peak_alloc_gib']:.2f} ({p['generate']:.2f} / {p['update']:.2f}) | {s['mismatch']:.4f} |")
    return "\n".join(lines)


def parent(args) -> None:
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    with tempfile.TemporaryDirectory(prefix="qlora_model_") as folder:
        start = time.perf_counter()
        args.folder = save_model_folder(args.size, folder)
        print(f"model folder ({args.size}, random bf16 weights) written in {time.perf_counter() - start:.1f} s",
              flush=True)
        results = {row: run_child(args, row) for row in rows}
    text = table(args, results)
    print(text, flush=True)
    if args.out:
        config = {k: v for k, v in vars(args).items() if k not in ("folder", "child", "json")}
        with open(args.out, "w") as fh:
            json.dump({"config": config, "device": _device_name(), "rows": results, "table": text}, fh, indent=1)
        record_run("QLoRA (4-bit base, merged bf16 copy or 4-bit engine) vs LoRA on bf16: GRPO step time and peak "
                   "memory", args.out, args.log)


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="measured steps after warmup")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--release-kv", action=argparse.BooleanOptionalAction, default=False,
                   help="generation.release_kv_during_update (the merged copy is released with the pool)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--child-timeout-s", type=float, default=280.0, help="kill a row after this long")
    p.add_argument("--out", default=None, help="JSON with every step of every row")
    p.add_argument("--log", default=None, help="append every row's output here")
    p.add_argument("--child", choices=list(ROWS), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        return parent(args)
    result = run_row(args, args.child)
    with open(args.json, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()

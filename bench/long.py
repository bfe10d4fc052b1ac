r"""Long reasoning: GRPO steps whose completions run to 4k-32k tokens, cohort against TRL 1.16 in one run (issue 33).

    python bench/long.py --sizes 1.5b --rows 4096 --prompts 8 --generations 8 --prompt-len 256
    python bench/long.py --sizes 1.5b --rows lognormal --median 1536 --tail-frac 0.05 --tail-at 8192 --cap 16384
    python bench/long.py --sizes tiny --rows lognormal,32 --prompts 2 --generations 2 --prompt-len 8 \
        --median 12 --tail-at 40 --cap 64 --warmup 0 --steps 1        # CPU smoke test of every path

Workload: bench/grpo_step.py's (the Qwen2.5 architecture with random bf16 weights, prompts of exactly
--prompt-len random tokens, EOS never ends a completion, a cheap length reward, beta = 0, one optimizer update
per step), with the completion lengths of a row:
- an integer N: every completion exactly N tokens (grpo_step's --completion-len N);
- `lognormal`: each completion's length drawn from a log-normal whose median is --median and of which
  --tail-frac lie past --tail-at (mu = ln median, sigma = ln(tail_at / median) / z, z the standard normal's
  1 - tail_frac quantile: 1.645 for 5%), rounded and clipped to [1, --cap]. One list per step (--prompts x
  --generations, prompt-major: a group's completions side by side), from random.Random(--seed) through the
  normal's inverse CDF, so the draw depends on the seed and the sizes only; its quantiles and the SHA-256 of the
  lists are printed and kept in the JSON. The measured steps' lists are the same for both trainers, step by
  step, whatever their warm-up counts (--warmup, --trl-warmup): warm-up steps take lists of their own, drawn
  from seed + 1.

How each trainer stops a sequence at its drawn length:
- cohort: its engine's per-sample caps (CohortEngine.generate's max_tokens_each): every sequence stops at its own
  length while the group still shares its prompt's KV cache, and leaves the batch then;
- TRL: Hugging Face `generate` cannot stop one row of a batch at a length of its own. Each generation call runs to
  the step's longest drawn length (min_new_tokens = max_new_tokens = that length, so EOS cannot end a row
  sooner) and each completion is then truncated to its drawn length before the loss, so the update sees exactly
  the drawn lengths. This gives TRL its real generation time: `generate` keeps every row of its batch in the
  forward until the longest row ends (a row that stops early is padded, not dropped), so a batch whose rows
  ended at the drawn lengths through EOS costs the same steps. The tokens sampled past a row's length are the
  only difference, and they are thrown away.

Runners (--runners): `cohort` (grpo_step's fast row: packed micro-batches, compiled layers, fp32 masters, KV pool
sized to the drawn tokens); `trl-fit` (TRL at the best settings that fit: without gradient checkpointing at the
largest micro-batch whose update fits 85% of the GPU by cohort's memory estimate of an eager Hugging Face update
(all of a micro-batch's completion logits at once, bf16 weights and Adam moments), else with it at the largest
that fits; --trl-micro / --trl-gc override the pick); `trl` (TRL's defaults: 8 completions per micro-batch,
gradient checkpointing). TRL 1.16 has no fused LM head of its own (Liger's needs the liger-kernel package, not
installed on the bench machines). Each (size, row, runner) runs in its own subprocess, one after another.

Each row's figures: seconds per step and its generate / update split (means over the steps after --warmup; TRL's
--trl-warmup may differ: a TRL step at 8k takes minutes), generated tokens per second while generating (the drawn
tokens over the generate phase), peak allocated GiB, update MFU (bench/flops.py's FLOPs of the drawn lengths over
the update seconds, at 989 TFLOP/s), and cohort's speed-up against the faster TRL row. --out writes the JSON
(every step of every run, the draw) and a manifest (bench/manifest.py).

A smaller GPU on a bigger one (--emulate-total-mib, e.g. 81559 for an H100 80GB HBM3 on an H200): each child
first allocates a ballast of (this GPU's total - the given total) MiB, so the driver's free memory, the memory
plan's fit check, the KV share and any allocation past the smaller card's size behave as on the smaller card;
the reported peaks have the ballast taken off. --release-kv: cohort's generation.release_kv_during_update=true
(the KV pool is freed while the policy updates).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from statistics import NormalDist
from types import SimpleNamespace
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s helpers, also when imported by path
from flops import update_flops
from manifest import record_run

RUNNERS = ("trl", "trl-fit", "cohort")
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16
TRL_FIT_SHARE = 0.85  # of the device's memory a TRL setting's estimated update may take


# ---------------------------------------------------------------------------------------------------------
# The length draw


def lognormal_sigma(median: float, tail_frac: float, tail_at: float) -> float:
    """The sigma of a log-normal with this median of which `tail_frac` lies past `tail_at`."""
    if not (0 < tail_frac < 0.5 and tail_at > median > 0):
        raise ValueError(f"need 0 < tail_frac ({tail_frac}) < 0.5 and tail_at ({tail_at}) > median ({median}) > 0")
    return math.log(tail_at / median) / NormalDist().inv_cdf(1.0 - tail_frac)


def draw_lengths(count: int, *, median: float, tail_frac: float, tail_at: float, cap: int, seed: int) -> list[int]:
    """`count` completion lengths from the log-normal of lognormal_sigma, rounded, in [1, cap]; fixed by `seed`
    (random.Random's uniforms through the normal's inverse CDF: the same list on every machine)."""
    sigma, rng, normal = lognormal_sigma(median, tail_frac, tail_at), random.Random(seed), NormalDist()
    out = []
    for _ in range(count):
        u = min(max(rng.random(), 1e-12), 1 - 1e-12)
        out.append(max(1, min(cap, round(median * math.exp(sigma * normal.inv_cdf(u))))))
    return out


def step_lengths(args, row: str, warmup: int = 0) -> list[list[int]] | None:
    """For a `lognormal` row, one list of --prompts x --generations lengths per step: `warmup` warm-up lists
    (drawn from seed + 1) then the --steps measured ones (from --seed: the same for every runner). None for a
    fixed-length row."""
    if row != "lognormal":
        return None
    n = args.prompts * args.generations

    def lists(count: int, seed: int) -> list[list[int]]:
        flat = draw_lengths(n * count, median=args.median, tail_frac=args.tail_frac, tail_at=args.tail_at,
                            cap=args.cap, seed=seed)
        return [flat[i * n:(i + 1) * n] for i in range(count)]
    return lists(warmup, args.seed + 1) + lists(args.steps, args.seed)


def describe(lengths: list[list[int]], tail_at: float) -> dict:
    """Quantiles, mean, the share past `tail_at` and the SHA-256 of a draw (what the run prints and keeps)."""
    flat = sorted(x for step in lengths for x in step)

    def q(p: float) -> int:
        return flat[min(len(flat) - 1, int(p * len(flat)))]

    digest = hashlib.sha256(json.dumps(lengths).encode()).hexdigest()
    return {"count": len(flat), "steps": len(lengths), "min": flat[0], "p10": q(0.1), "p50": q(0.5), "p90": q(0.9),
            "p95": q(0.95), "p99": q(0.99), "max": flat[-1], "mean": sum(flat) / len(flat),
            "past_tail_at": sum(x > tail_at for x in flat) / len(flat), "sha256": digest}


def row_max_len(args, row: str) -> int:
    return args.cap if row == "lognormal" else int(row)


# ---------------------------------------------------------------------------------------------------------
# Per-sequence stops, both trainers


def stop_each(generate, lengths: list[list[int]]):
    """cohort: `engine.generate(prompts, params)` that gives sample j of prompt i the step's cap [i * n + j]
    (CohortEngine's max_tokens_each), one list per call."""
    calls = iter(lengths)

    def wrapped(prompts, params):
        caps = next(calls, None)
        if caps is None or len(caps) != len(prompts) * params.n:
            raise RuntimeError(f"stop_each: a generate call of {len(prompts)} x {params.n} sequences does not match "
                               "the drawn lengths (one list of prompts x generations per step)")
        n = params.n
        return generate(prompts, params, max_tokens_each=[caps[i * n:(i + 1) * n] for i in range(len(prompts))])
    return wrapped


def truncate_each(generate_single_turn, trainer, lengths: list[list[int]]):
    """TRL: `_generate_single_turn` run to the step's longest drawn length, each completion then cut to its own
    (the module docstring says why this is TRL's real generation time)."""
    calls = iter(lengths)

    def wrapped(prompt_ids, *a, **k):
        caps = next(calls, None)
        if caps is None or len(caps) != len(prompt_ids):
            raise RuntimeError(f"truncate_each: a generate call of {len(prompt_ids)} rows does not match the drawn "
                               "lengths (one list of prompts x generations per step)")
        longest = max(caps)
        trainer.generation_config.max_new_tokens = trainer.generation_config.min_new_tokens = longest
        trainer.generation_kwargs.update(max_new_tokens=longest, min_new_tokens=longest)
        completion_ids, logprobs = generate_single_turn(prompt_ids, *a, **k)
        cut = [list(ids[:cap]) for ids, cap in zip(completion_ids, caps)]
        return cut, (None if logprobs is None else [lp[:cap] for lp, cap in zip(logprobs, caps)])
    return wrapped


# ---------------------------------------------------------------------------------------------------------
# TRL's settings


def trl_fit(spec: dict, sequences: int, prompt_len: int, completion_len: int, device_bytes: float,
            share: float = TRL_FIT_SHARE) -> tuple[int, bool]:
    """(completions per micro-batch, gradient checkpointing) for TRL: no checkpointing at the largest micro-batch
    (a divisor of `sequences`, at most 32) whose update fits `share` of the device by cohort's estimate of an
    eager Hugging Face update, else checkpointing at the largest that fits; (1, True) when nothing does."""
    from cohort.policy.memory import estimate_memory

    config = {"model_type": "qwen2", "tie_word_embeddings": True, **spec}
    micros = [m for m in range(min(32, sequences), 0, -1) if sequences % m == 0]
    for checkpointing in (False, True):
        for micro in micros:
            est = estimate_memory(config, dtype="bf16", master_weights_fp32=False, lm_head_grad_fp32=False,
                                  token_budget=micro * (prompt_len + completion_len),
                                  completion_tokens=micro * completion_len, chunk_tokens=micro * completion_len,
                                  gradient_checkpointing=checkpointing, fused_logprob_kernels=False)
            if est.total <= share * device_bytes:
                return micro, checkpointing
    return 1, True


# ---------------------------------------------------------------------------------------------------------
# One run (child)


def workload(args, row: str, size: str, warmup: int) -> SimpleNamespace:
    """The namespace bench/grpo_step.py's runners read, for one row and a runner's warm-up count."""
    length = row_max_len(args, row)
    lengths = step_lengths(args, row, warmup)
    kv_tokens = (max(sum(args.prompt_len + x for x in step) for step in lengths) if lengths else None)
    return SimpleNamespace(
        size=size, device=args.device, warmup=warmup, steps=args.steps, prompts=args.prompts,
        generations=args.generations, prompt_len=args.prompt_len, completion_len=length,
        token_budget=args.token_budget,
        chunk_tokens=None, compile_layers=args.compile_layers, profile_update=False, profile_generate=False,
        lowmem_token_budget=None, lowmem_chunk_tokens=256, lowmem_offload=True, lowmem_release_kv=True, mem_cap=None,
        trl_tuned_micro=args.trl_micro, trl_tuned_gc=args.trl_gc, packed_attention="torch", share_prompts=True,
        kv_tokens=kv_tokens, flash_attention_impl=None, release_kv=getattr(args, "release_kv", False))


def run_one(args) -> dict:
    """The child: one (size, row, runner) with its per-sequence stops; returns grpo_step's result dict."""
    import grpo_step

    size, row = args.size, args.row
    spec = dict(grpo_step.SIZES[size])
    spec["max_position_embeddings"] = max(32768, args.prompt_len + row_max_len(args, row))  # the 32k rows need more
    grpo_step.SIZES[size] = spec
    warmup = args.warmup if args.child == "cohort" else args.trl_warmup
    ns = workload(args, row, size, warmup)
    ballast = emulate_smaller_gpu(args.emulate_total_mib) if args.emulate_total_mib else None
    try:
        res = _run_runner(args, ns, lengths_of=step_lengths(args, row, warmup))
    finally:
        ballast_gib = ballast.numel() / 2**30 if ballast is not None else 0.0
        del ballast
    res["release_kv"] = bool(args.release_kv)
    if ballast_gib:
        for key in ("peak_alloc_gib", "peak_reserved_gib"):
            if key in res:
                res[key] -= ballast_gib
        if isinstance(res.get("phase_peak_alloc_gib"), dict):
            res["phase_peak_alloc_gib"] = {k: v - ballast_gib for k, v in res["phase_peak_alloc_gib"].items()}
        res.update(emulated_total_mib=args.emulate_total_mib, ballast_gib=ballast_gib)
    return res


def emulate_smaller_gpu(total_mib: int):
    """Allocate (this GPU's total - total_mib) MiB and keep it: what is left behaves as a card of total_mib."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    ballast = total - total_mib * 2**20
    if ballast <= 0:
        raise SystemExit(f"--emulate-total-mib={total_mib}: this GPU has only {total / 2**20:.0f} MiB")
    print(f"emulating a {total_mib} MiB GPU: {ballast / 2**30:.2f} GiB ballast on a {total / 2**20:.0f} MiB one",
          flush=True)
    return torch.empty(ballast, dtype=torch.uint8, device="cuda")


def _run_runner(args, ns, lengths_of) -> dict:
    """The child's runner with each sequence stopped at its drawn length."""
    import grpo_step
    import grpo_step_trl

    lengths = lengths_of
    if args.child == "cohort":
        import cohort.trainer

        build = cohort.trainer.build_components

        def build_with_stops(*a, **k):
            comp = build(*a, **k)
            if lengths is not None:
                comp.engine.generate = stop_each(comp.engine.generate, lengths)
            return comp
        with mock.patch.object(cohort.trainer, "build_components", build_with_stops):
            return grpo_step.run_cohort(ns, lowmem=False)
    make = grpo_step_trl._trl_trainer

    def trainer_with_stops(*a, **k):
        trainer = make(*a, **k)
        if lengths is not None:
            trainer._generate_single_turn = truncate_each(trainer._generate_single_turn, trainer, lengths)
        return trainer
    with mock.patch.object(grpo_step_trl, "_trl_trainer", trainer_with_stops):
        return grpo_step_trl.run_trl(ns, tuned=args.child == "trl-fit")


# ---------------------------------------------------------------------------------------------------------
# Parent: the rows, the table


def summarise(args, res: dict, size: str, row: str, warmup: int) -> dict:
    """Means over the measured steps: phases, generated tok/s while generating, update MFU of the drawn lengths."""
    import grpo_step

    lengths = step_lengths(args, row, warmup)
    n = args.prompts * args.generations
    steps = res["steps"]
    measured = list(range(len(steps)))[warmup:] or list(range(len(steps)))
    per_step = [lengths[i] if lengths else [int(row)] * n for i in range(len(steps))]
    shared = args.generations if res.get("share_prompts") else 1
    spec = grpo_step.SIZES[size]
    flops = [sum(update_flops(spec, num_params=res["num_params"], tied=True, sequences=1, prompt_len=args.prompt_len,
                              completion_len=x, shared=shared) for x in per_step[i]) for i in measured]
    mean = {k: sum(steps[i][k] for i in measured) / len(measured) for k in ("step", "generate", "update", "other")}
    tokens = sum(sum(per_step[i]) for i in measured) / len(measured)
    mean["gen_tok_s"] = tokens / max(mean["generate"], 1e-9)
    mean["mfu"] = sum(flops) / len(flops) / max(mean["update"], 1e-9) / PEAK_FLOPS
    mean["tokens_per_step"], mean["measured_steps"] = tokens, len(measured)
    return mean


def run_child(args, size: str, row: str, runner: str, timeout: float) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", runner, "--size", size, "--row", row, "--json", out]
    for name in ("device", "warmup", "trl_warmup", "steps", "prompts", "generations", "prompt_len", "median",
                 "tail_frac", "tail_at", "cap", "seed", "token_budget", "emulate_total_mib"):
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    cmd += ["--compile-layers" if args.compile_layers else "--no-compile-layers"]
    cmd += ["--release-kv"] if args.release_kv else []
    if runner == "trl-fit":
        micro, gc = args.trl_micro, args.trl_gc
        if micro is None:
            device_bytes = _device_bytes(args.device)
            import grpo_step

            micro, gc = trl_fit(grpo_step.SIZES[size], args.prompts * args.generations, args.prompt_len,
                                row_max_len(args, row), device_bytes) if device_bytes else (1, False)
        cmd += ["--trl-micro", str(micro), "--trl-gc" if gc else "--no-trl-gc"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        log, ok = proc.stdout + proc.stderr, proc.returncode == 0 and os.path.exists(out)
    except subprocess.TimeoutExpired as exc:
        log, ok = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout:.0f} s", False
    wall = time.perf_counter() - start
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(f"\n===== {size} {row} {runner} ({wall:.0f} s) =====\n{log}")
    if not ok:
        tail = "\n".join(log.strip().splitlines()[-12:])
        print(f"[{size} {row} {runner}] FAILED after {wall:.0f} s:\n{tail}", flush=True)
        return {"error": tail.splitlines()[-1] if tail else "failed", "wall_s": wall}
    with open(out) as fh:
        res = json.load(fh)
    res["wall_s"] = wall
    res["summary"] = summarise(args, res, size, row, args.trl_warmup if runner.startswith("trl") else args.warmup)
    keys = ("micro_batch", "gradient_accumulation_steps", "gradient_checkpointing", "token_budget", "kv_planned_gib",
            "plan_estimate_gib")
    print(f"[{size} {row} {runner}] {wall:.0f} s wall: {json.dumps(res['summary'])} "
          f"{json.dumps({k: res[k] for k in keys if k in res})}", flush=True)
    return res


def _device_bytes(device: str) -> float | None:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if device == "cuda" else None


def settings_cell(runner: str, res: dict) -> str:
    if runner == "cohort":
        plan = f", plan {res['plan_estimate_gib']:.1f} GiB" if "plan_estimate_gib" in res else ""
        plan += ", KV released in update" if res.get("release_kv") else ""
        plan += f", as a {res['emulated_total_mib']} MiB GPU" if res.get("emulated_total_mib") else ""
        return f"budget {res.get('token_budget')}, KV {res.get('kv_planned_gib', 0):.1f} GiB{plan}"
    return f"micro {res.get('micro_batch')} x {res.get('gradient_accumulation_steps')}, " \
           f"GC {'on' if res.get('gradient_checkpointing') else 'off'}"


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e3:.1f}k" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f}"


def table(args, results: dict) -> str:
    head = ("| model | row | trainer | settings | s/step | generate | update | other | generated tok/s | "
            "peak alloc GiB | update MFU | vs faster TRL |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | "
            "--- | --- | --- |")
    rows = []
    for (size, row), by_runner in results.items():
        ran = [(r, v) for r, v in by_runner.items() if r.startswith("trl") and "summary" in v]
        best = min(ran, key=lambda item: item[1]["summary"]["step"]) if ran else None
        label = f"lognormal (median {args.median:g}, {args.tail_frac:.0%} past {args.tail_at:g}, cap {args.cap})" \
            if row == "lognormal" else f"{args.prompts * args.generations} x ({args.prompt_len} + {row})"
        for runner, res in by_runner.items():
            if "summary" not in res:
                rows.append(f"| {size} | {label} | {runner} | failed: {res.get('error', '?')[:80]} |" + " |" * 8)
                continue
            s = res["summary"]
            vs = f"{best[1]['summary']['step'] / s['step']:.2f}x ({best[0]})" if best and runner == "cohort" else ""
            rows.append(f"| {size} | {label} | {runner} | {settings_cell(runner, res)} | {s['step']:.2f} | "
                        f"{s['generate']:.2f} | {s['update']:.2f} | {s['other']:.2f} | {_rate(s['gen_tok_s'])} | "
                        f"{res.get('peak_alloc_gib', float('nan')):.2f} | {100 * s['mfu']:.1f}% | {vs} |")
    return "\n".join([head, *rows])


def parent(args) -> None:
    deadline = time.monotonic() + args.budget_s
    draws = {}
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for row in rows:
        lengths = step_lengths(args, row)  # the measured steps' lists (warm-up lists differ per runner)
        if lengths is not None:
            d = draws[row] = {**describe(lengths, args.tail_at), "lengths": lengths}
            print(f"lengths ({row}, seed {args.seed}, measured steps): {d['count']} completions over {d['steps']} "
                  f"steps; p10 {d['p10']} p50 {d['p50']} p90 {d['p90']} p95 {d['p95']} p99 {d['p99']} max {d['max']}; "
                  f"mean {d['mean']:.0f}; {d['past_tail_at']:.1%} past {args.tail_at:g}; sha256 {d['sha256'][:16]}",
                  flush=True)
    results: dict = {}
    order = [r for r in RUNNERS if r in args.runners.split(",")]
    for size in args.sizes.split(","):
        for row in rows:
            results[(size, row)] = {}
            for runner in order:
                left = deadline - time.monotonic()
                if left < 30:
                    results[(size, row)][runner] = {"error": "skipped (time budget)"}
                    continue
                results[(size, row)][runner] = run_child(args, size, row, runner, min(left, args.child_timeout_s))
    print("\n" + table(args, results), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "draws": draws,
                       "results": {f"{s} {r}": v for (s, r), v in results.items()}}, fh, indent=1, default=str)
        record_run(f"bench/long.py: long-reasoning GRPO steps, sizes {args.sizes}, rows {args.rows}", args.out, args.log)


def main(argv=None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1.5b")
    p.add_argument("--rows", default="lognormal", help="comma list: lognormal and/or completion lengths (4096, ...)")
    p.add_argument("--runners", default="trl-fit,cohort", help=f"comma list of {', '.join(RUNNERS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trl-warmup", type=int, default=None, help="TRL rows' warm-up steps (default --warmup)")
    p.add_argument("--steps", type=int, default=1, help="measured steps after warm-up")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--median", type=float, default=1536)
    p.add_argument("--tail-frac", type=float, default=0.05)
    p.add_argument("--tail-at", type=float, default=8192)
    p.add_argument("--cap", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-budget", type=int, default=None, help="cohort: train.token_budget (default: "
                   "bench/grpo_step.py's fast row's, rounded up to whole sequences)")
    p.add_argument("--trl-micro", type=int, default=None, help="trl-fit: completions per micro-batch (default: "
                   "picked by the estimate)")
    p.add_argument("--trl-gc", action=argparse.BooleanOptionalAction, default=False,
                   help="trl-fit with --trl-micro: gradient checkpointing")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available())
    p.add_argument("--emulate-total-mib", type=int, default=None, help="behave as a GPU of this many MiB (a "
                   "ballast fills the rest; 81559: an H100 80GB HBM3); the peaks exclude the ballast")
    p.add_argument("--release-kv", action="store_true", help="cohort: generation.release_kv_during_update=true")
    p.add_argument("--budget-s", type=float, default=86400.0, help="start no run after this long")
    p.add_argument("--child-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_warmup is None:
        args.trl_warmup = args.warmup
    unknown = [r for r in args.runners.split(",") if r not in RUNNERS]
    bad_rows = [r for r in args.rows.split(",") if r != "lognormal" and not r.isdigit()]
    if unknown or bad_rows:
        p.error(f"unknown runner {unknown} or row {bad_rows}: runners {', '.join(RUNNERS)}; rows lognormal or N")
    if args.child is None:
        return parent(args)
    result = run_one(args)
    with open(args.json, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()

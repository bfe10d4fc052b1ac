r"""Long-tailed completion lengths on N GPUs: synchronous colocated data parallel against asynchronous rollouts
(`train.async_rollouts` with `train.max_staleness` k), tokens per second, one table, one run (issue 34).

Device command (4 GPUs, from the repository root; every row is its own torchrun launch):

    PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false python3 bench/async_long.py \
        --gpus 4 --rows sync,async1,async2 --out $OUT/async_long.json --log $OUT/async_long.log

(rows that --budget-s leaves out print as skipped: run them in a second call with --rows sync,asyncK, keeping a
`sync` row in every call so that each ratio has its same-run baseline. cohort's engine decodes at most 256
sequences at once: with --prompts 16 x --generations 8 an asyncK row holds (K + 1) x 128 per GPU, so K >= 2
queues some, which also keeps multi-step decode launches from chaining while they wait.)

    python3 bench/async_long.py --device cpu --gpus 2 --size tiny --rows sync,async1 --prompts 2 \
        --generations 2 --prompt-len 8 --median 6 --tail-at 20 --min-len 2 --cap 32 --warmup 1 --steps 2
                                                        # CPU smoke test (gloo, 2 ranks)

Workload: bench/grpo_step.py's (the Qwen2.5 architecture, 1.5B by default, random bf16 weights, prompts of
--prompt-len random tokens, a cheap length reward, beta 0, one optimizer update per step, its fast cohort
settings, compiled decoder layers) on --gpus ranks of data parallelism (train.sharding=none), --prompts prompts
per GPU x --generations completions, with long-tailed completion lengths: EOS never ends a completion, each one
stops at a length drawn from bench/long.py's log-normal (median --median, --tail-frac of them past --tail-at),
clipped to [--min-len, --cap] (64 and 8,192 by default). The lengths belong to the prompt, not to the run: the
c-th chunk of prompts a rank draws (one step's worth: the synchronous run's step c + 1) gets the draw seeded by
(--seed, rank, c), so every row trains on the same prompts with the same lengths, in whatever order its steps
take them. Every row gets the same KV pool: (1 + the largest k) x the largest chunk's tokens, x1.25.

Rows (--rows): `sync` (train.async_rollouts=false: each step waits for its longest sequence, on every rank) and
`asyncK` (train.async_rollouts=true, train.max_staleness=K: a step trains on the first groups to finish, the rest
continue with the new weights; up to (K + 1) x prompts groups per GPU in flight). Every row runs --warmup +
--steps + the largest K steps; the table averages the --steps after the warm-up (the last ones are left out:
an asynchronous run drains its pipeline there).

Columns: seconds per step, its generate and update phases (the slowest rank's), trained tokens per second over all
GPUs (prompt + completion tokens of the steps / their seconds) and of them the sampled completion tokens, the
ratio to the `sync` row, staleness/mean and /max (versions, over sampled tokens) and the share of steps that
waited for a group at its staleness bound (async/paced). The best asynchronous row is marked; issue 34's target
is >= 1.5x the `sync` row's tokens per second. --out writes the JSON (every step of every row, the draws' summary)
and its manifest (bench/manifest.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # grpo_step / long / scale live beside this file
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from long import describe, draw_lengths  # noqa: E402
from manifest import record_run  # noqa: E402
from scale import _init_dist, _read_ranks, error_line, launch  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# The lengths


def chunk_lengths(args, rank: int, chunk: int) -> list[int]:
    """The completion lengths of rank `rank`'s chunk `chunk` (prompts x generations, prompt-major), in
    [--min-len, --cap]."""
    seed = args.seed * 1_000_003 + rank * 10_007 + chunk
    drawn = draw_lengths(args.prompts * args.generations, median=args.median, tail_frac=args.tail_frac,
                         tail_at=args.tail_at, cap=args.cap, seed=seed)
    return [max(args.min_len, x) for x in drawn]


def staleness_of(row: str) -> int | None:
    """None for `sync`, K for `asyncK`."""
    if row == "sync":
        return None
    if row.startswith("async") and row[5:].isdigit():
        return int(row[5:])
    raise SystemExit(f"--rows: unknown row {row!r}; use sync or asyncK (K = train.max_staleness, e.g. async1)")


def total_steps(args) -> int:
    """Warm-up, measured steps, and the drain of the most asynchronous row (the same count in every row)."""
    return args.warmup + args.steps + max([staleness_of(r) or 0 for r in args.rows.split(",")] or [0])


# ---------------------------------------------------------------------------------------------------------
# Worker: one rank of one row (under torchrun)


def _sync_caps(generate, lengths):
    """The synchronous engine's generate, each call (step) with its chunk's lengths as per-sample caps."""
    calls = iter(range(1 << 30))

    def wrapped(prompts, params):
        caps = lengths(next(calls))
        n = params.n
        return generate(prompts, params, max_tokens_each=[caps[i * n:(i + 1) * n] for i in range(len(prompts))])
    return wrapped


def _config(args, model, device, world: int, rank: int):
    from grpo_step import _cohort_config, _kv_plan

    k = staleness_of(args.row)
    biggest = max(sum(args.prompt_len + x for x in chunk_lengths(args, r, c))
                  for r in range(world) for c in range(total_steps(args)))
    ks = [staleness_of(r) or 0 for r in args.rows.split(",")]
    plan = argparse.Namespace(size=args.size, prompts=args.prompts, generations=args.generations,
                              prompt_len=args.prompt_len, completion_len=args.cap, warmup=args.warmup,
                              steps=args.steps, profile_update=False, token_budget=args.token_budget,
                              chunk_tokens=None, mem_cap=None, kv_tokens=(1 + max(ks)) * biggest,
                              compile_layers=args.compile_layers)
    kv_fraction, budget, info = _kv_plan(plan, model, device, lowmem=False)
    cfg = _cohort_config(plan, False, kv_fraction, budget)
    cfg.train.prompts_per_step, cfg.train.max_steps = args.prompts * world, total_steps(args)
    cfg.train.async_rollouts, cfg.train.max_staleness = k is not None, k or 0
    cfg.run.output_dir = args.run_dir
    info.update(kv_cache_fraction=kv_fraction, token_budget=budget, kv_tokens=plan.kv_tokens)
    return cfg, info


def run_worker(args) -> None:
    from unittest import mock

    from grpo_step import build_model, build_tokenizer, length_reward, make_prompts

    import cohort.trainer
    from cohort.data.dataset import PromptDataset
    from cohort.rewards import RewardRunner

    device, rank, world = _init_dist(args.device)
    model = build_model(args.size, device)
    tok = build_tokenizer(model.config.vocab_size)
    cfg, info = _config(args, model, device, world, rank)
    # more prompts than the steps take: an asynchronous run draws up to k chunks ahead
    count = cfg.train.prompts_per_step * (cfg.train.max_steps + cfg.train.max_staleness + 1)
    data = PromptDataset([{"prompt": p} for p in make_prompts(count, args.prompt_len, model.config.vocab_size)],
                         "bench").encode(tok, args.prompt_len)
    lengths = functools.lru_cache(maxsize=None)(lambda chunk: chunk_lengths(args, rank, chunk))
    g = args.generations
    streamed = functools.partial(cohort.trainer.StreamingRollouts,
                                 caps=lambda chunk, row: lengths(chunk)[row * g:(row + 1) * g])
    echo = print if rank == 0 else (lambda *a, **k: None)
    with mock.patch.object(cohort.trainer, "_save", lambda *a, **k: None), \
            mock.patch.object(cohort.trainer, "StreamingRollouts", streamed):
        comp = cohort.trainer.build_components(cfg, policy=model, tokenizer=tok, train_data=data, echo=echo,
                                               reward_runner=RewardRunner([length_reward]))
        if not cfg.train.async_rollouts:
            comp.engine.generate = _sync_caps(comp.engine.generate, lengths)
        result = cohort.trainer.train(cfg, comp, echo=echo)
    out = {"rank": rank, "world": world}
    if rank == 0:
        out.update(history=result.history, **info,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    with open(os.path.join(args.json_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh, default=str)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Parent: the rows, the table


def summarise(args, history: list[dict], gpus: int) -> dict:
    """Means over the measured steps (after --warmup, before the drain)."""
    tokens, before = [], 0
    for m in history:
        tokens.append(m["num_tokens"] - before)
        before = m["num_tokens"]
    measured = list(range(args.warmup, min(len(history), args.warmup + args.steps)))
    seconds = sum(history[i]["step_time"] for i in measured)
    prompt_tokens = gpus * args.prompts * args.generations * args.prompt_len  # per step, all ranks
    total = sum(tokens[i] for i in measured)
    mean = lambda key: sum(float(history[i].get(key, 0.0)) for i in measured) / len(measured)  # noqa: E731
    return {"step": seconds / len(measured), "generate": mean("time/generate"), "update": mean("time/update"),
            "tok_s": total / seconds, "sampled_tok_s": (total - prompt_tokens * len(measured)) / seconds,
            "staleness_mean": mean("staleness/mean"), "staleness_max": max(
                [float(history[i].get("staleness/max", 0.0)) for i in measured]),
            "paced": mean("async/paced"), "measured_steps": len(measured)}


def run_row(args, row: str, timeout: float, work: str) -> dict:
    json_dir = tempfile.mkdtemp(prefix=f"{row}_", dir=work)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
           os.path.abspath(__file__), "--worker", "--row", row, "--json-dir", json_dir,
           "--run-dir", os.path.join(json_dir, "run"), *args.passthrough]
    log_path = os.path.join(json_dir, "log.txt")
    threads = max(1, (os.cpu_count() or 1) // args.gpus)
    status, wall = launch(cmd, timeout, log_path, threads=threads)
    with open(log_path, errors="replace") as fh:
        log = fh.read()
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(f"\n===== {row}: {status}, {wall:.0f} s =====\n{log}")
    rank0 = next((r for r in _read_ranks(json_dir, args.gpus) if "history" in r), None)
    if status != "ok" or rank0 is None:
        return {"row": row, "status": status, "wall_s": wall, "error": error_line(log)}
    return {"row": row, "status": status, "wall_s": wall, "history": rank0["history"],
            "device_name": rank0.get("device_name"), "kv_tokens": rank0.get("kv_tokens"),
            "summary": summarise(args, rank0["history"], args.gpus)}


def table(results: list[dict]) -> str:
    base = next((r["summary"] for r in results if r["row"] == "sync" and "summary" in r), None)
    asyncs = [r for r in results if r["row"] != "sync" and "summary" in r]
    best = max(asyncs, key=lambda r: r["summary"]["tok_s"])["row"] if asyncs else None
    out = ["| row | s/step | generate s | update s | tokens/s (all GPUs) | sampled tok/s | vs sync | "
           "staleness mean / max | paced steps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r.get("summary")
        if s is None:
            out.append(f"| {r['row']} | {r.get('error', r['status'])} |  |  |  |  |  |  |  |")
            continue
        vs = f"{s['tok_s'] / base['tok_s']:.2f}x" if base else ""
        mark = " (best async)" if r["row"] == best else ""
        out.append(f"| {r['row']}{mark} | {s['step']:.2f} | {s['generate']:.2f} | {s['update']:.2f} | "
                   f"{s['tok_s']:,.0f} | {s['sampled_tok_s']:,.0f} | {vs} | {s['staleness_mean']:.2f} / "
                   f"{s['staleness_max']:.0f} | {s['paced']:.0%} |")
    return "\n".join(out)


def parent(args) -> int:
    started = time.monotonic()
    deadline = started + args.budget_s
    work = tempfile.mkdtemp(prefix="cohort_async_long_")
    draw = [chunk_lengths(args, r, c) for r in range(args.gpus) for c in range(total_steps(args))]
    d = describe(draw, args.tail_at)
    print(f"lengths: {d['count']} completions; p10 {d['p10']} p50 {d['p50']} p90 {d['p90']} p99 {d['p99']} max "
          f"{d['max']}; mean {d['mean']:.0f}; {d['past_tail_at']:.1%} past {args.tail_at:g}; sha256 "
          f"{d['sha256'][:16]}", flush=True)
    results = []
    for row in args.rows.split(","):
        left = deadline - time.monotonic()
        if left < 30:
            results.append({"row": row, "status": "skipped", "error": "skipped (--budget-s)"})
            continue
        print(f"[+{time.monotonic() - started:5.0f} s] start {row}", flush=True)
        res = run_row(args, row, min(left, args.child_timeout_s), work)
        results.append(res)
        print(f"[+{time.monotonic() - started:5.0f} s] {row}: {res.get('summary') or res.get('error')}", flush=True)
    print("\n" + table(results), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "lengths": d, "results": results}, fh, indent=1, default=str)
        record_run(f"bench/async_long.py: long-tailed lengths on {args.gpus} GPUs, sync vs async_rollouts",
                   args.out, args.log)
    return 0


WORKLOAD = ("size", "device", "prompts", "generations", "prompt_len", "median", "tail_frac", "tail_at",
            "min_len", "cap", "seed", "warmup", "steps", "rows", "gpus", "token_budget")


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=4, help="ranks (GPUs) of every row")
    p.add_argument("--rows", default="sync,async1,async2", help="comma list: sync and/or asyncK")
    p.add_argument("--size", default="1.5b", help="bench/grpo_step.py's model size (tiny: CPU smoke test)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--prompts", type=int, default=16, help="prompts per GPU per step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--median", type=float, default=512)
    p.add_argument("--tail-frac", type=float, default=0.05)
    p.add_argument("--tail-at", type=float, default=2048)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--cap", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps after warm-up")
    p.add_argument("--token-budget", type=int, default=16384, help="train.token_budget")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=cuda)
    p.add_argument("--budget-s", type=float, default=540.0, help="start no row after this long")
    p.add_argument("--child-timeout-s", type=float, default=300.0, help="kill a row's launch after this long")
    p.add_argument("--out", default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--json-dir", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for row in args.rows.split(","):
        staleness_of(row)
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in WORKLOAD if getattr(args, k) is not None]
    args.passthrough.append("--compile-layers" if args.compile_layers else "--no-compile-layers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

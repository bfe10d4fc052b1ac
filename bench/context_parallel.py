"""The GRPO update at long sequences with FSDP2 + context parallelism (train.context_parallel), one table, one run.

Device command (from the repository root; one 10-minute call on 4 H100s with the defaults: Qwen2.5-7B's
architecture, 8 sequences of 256 + 32,768 tokens, rows with context_parallel 4, 2 and 1):

    export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 && python3 bench/context_parallel.py --out $OUT/cp.json --log $OUT/cp.log

    python3 bench/context_parallel.py --device cpu --size tiny --gpus 2 --cp 2,1 --sequences 4 \\
        --prompt-len 8 --completion-len 56 --out /tmp/cp.json                 # CPU smoke test (gloo, 2 ranks)

What one row measures: `cohort.update.PolicyUpdater.update`, the learning half of a GRPO step (packed
forward and backward of every micro-batch, gradient reduce-scatter, optimizer step), on synthetic rollouts:
--sequences sequences of exactly --prompt-len + --completion-len random tokens, each rank holding an equal share
(as a rank's own rollouts), advantages of +-1, the dapo loss (token-level), one optimizer update per step, no
reference model. Generation is not run: at 32k tokens a 7B step is dominated by it, and context parallelism
changes only the update. The model is the --size architecture (7b: Qwen2.5-7B, hidden 3584, 28 layers, 28
heads, 4 KV heads, untied embeddings, as bench/scale.py's big row) with random bf16 weights, sharded with FSDP2
over all --gpus ranks (fp32 master weights and Adam state, bf16 compute, `cohort.distributed.fsdp.shard_model`),
gradient checkpointing on (--no-checkpointing: off). Each row sets train.context_parallel = CP (from --cp):
--gpus / CP data-parallel groups of CP ranks, each packed row (one sequence when --token-budget is 0: the
sequence length rounded up to a multiple of 2 CP) split over its group. CP=1 is the baseline: FSDP2 alone, a
whole sequence's activations on one GPU (it may not fit: the row then says so).

Columns: seconds per update (mean of the --steps after --warmup; the slowest rank's), (prompt + completion)
tokens per second per GPU, the update MFU (bench/flops.py's update FLOPs, recomputation not counted, / seconds /
GPUs / 989e12, H100 dense bf16) and the peak allocated GiB (max over ranks, over the measured steps). Each row is
its own torchrun launch; a row is skipped when what is left of --budget-s (540) cannot hold it, and killed at the
budget, so the table always prints. --out gets the JSON (every row, the arguments, the device), with
bench/manifest.py's manifest beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # grpo_step / scale / flops / manifest live beside this file
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from flops import update_flops  # noqa: E402
from grpo_step import PEAK_FLOPS, SIZES  # noqa: E402
from manifest import record_run  # noqa: E402

BIG = {"7b": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
              "intermediate_size": 18944, "vocab_size": 152064}}
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # NVLink multicast off
ROW_ESTIMATE_S = {"cuda": 150.0, "cpu": 30.0}  # until a row has run: setup (7B build, sharding) + steps


def spec_of(size: str) -> tuple[dict, bool]:
    """(architecture, tied embeddings) of --size."""
    return (BIG[size], False) if size in BIG else (SIZES[size], True)


# ---------------------------------------------------------------------------------------------------------
# Worker: one rank of one row (under torchrun)


def synthetic_batch(args, rank: int, world: int):
    """This rank's rollouts: sequences / world of them (one prompt's group), random tokens, advantages +-1."""
    from cohort.types import RolloutBatch

    rows = args.sequences // world
    spec, _ = spec_of(args.size)
    gen = torch.Generator().manual_seed(1000 + rank)
    vocab = spec["vocab_size"] - 1  # below the EOS id (the last one for small vocabularies): never a stop token
    prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
    completions = [torch.randint(0, vocab, (args.completion_len,), generator=gen).tolist() for _ in range(rows)]
    return RolloutBatch(
        prompt_ids=[prompt] * rows, completion_ids=completions,
        sampling_logprobs=[[float("nan")] * args.completion_len] * rows,  # not reported: importance weight 1
        finish_reasons=["length"] * rows, completions_text=[""] * rows, prompts=[""] * rows,
        rewards_per_func=torch.zeros(rows, 1), rewards=torch.zeros(rows),
        advantages=torch.tensor([1.0 if (rank + i) % 2 == 0 else -1.0 for i in range(rows)]),
        loss_mask_keep=[True] * rows, group_size=rows)


def build(args, device: torch.device, cp: int):
    """The sharded policy and its PolicyUpdater, as cohort.setup builds them for train.sharding=fsdp."""
    from grpo_step import build_model

    from cohort.algorithms import build_policy_loss
    from cohort.distributed.fsdp import shard_model
    from cohort.policy.optim import build_optimizer, build_scheduler
    from cohort.update import PolicyUpdater, UpdateSettings

    spec, tied = spec_of(args.size)
    length = args.prompt_len + args.completion_len
    model = build_model(args.size, device, spec={**spec, "max_position_embeddings": max(32768, length)}, tie=tied)
    num_params = sum(p.numel() for p in model.parameters())
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    shard_model(model, device=device, master_weights=True)
    optimizer = build_optimizer(model, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.99))
    scheduler = build_scheduler(optimizer, kind="constant", warmup_steps=0, total_steps=args.warmup + args.steps)
    budget = args.token_budget or -(-length // (2 * cp)) * (2 * cp)
    settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=budget, temperature=1.0,
                              max_grad_norm=1.0, max_completion_length=args.completion_len,
                              chunk_tokens=args.chunk_tokens, sharded=True, context_parallel=cp)
    updater = PolicyUpdater(model, optimizer, scheduler, build_policy_loss("dapo", {}), settings, device=device)
    return updater, num_params, budget


def run_worker(args) -> None:
    import torch.distributed as dist

    from cohort import distributed
    from cohort.run.timing import PhaseTimer

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = distributed.init_from_env(timeout_s=300)
    rank, world = info.rank, info.world_size
    out = {"rank": rank, "world": world, "cp": args.row_cp}
    try:
        updater, num_params, budget = build(args, device, args.row_cp)
        batch = synthetic_batch(args, rank, world)
        times = []
        for step in range(args.warmup + args.steps):
            if step == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            distributed.barrier()
            start = time.perf_counter()
            updater.step = step
            updater.update(batch, PhaseTimer())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(distributed.reduce_metrics({"time": time.perf_counter() - start})["time"])  # slowest
        out.update(step_s=times[args.warmup:], warmup_s=times[:args.warmup], num_params=num_params,
                   token_budget=budget,
                   peak_alloc_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    except torch.cuda.OutOfMemoryError as exc:
        out["error"] = f"out of memory: {str(exc)[:200]}"
        raise
    finally:
        with open(os.path.join(args.json_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(out, fh)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Launcher: one torchrun per row, the table


def worker_args(args) -> list[str]:
    """The row's settings for its ranks (written out in full: torchrun would take an abbreviation such as --log
    for one of its own options)."""
    out = [f"--size={args.size}", f"--gpus={args.gpus}", f"--sequences={args.sequences}",
           f"--prompt-len={args.prompt_len}", f"--completion-len={args.completion_len}",
           f"--token-budget={args.token_budget}", f"--chunk-tokens={args.chunk_tokens}", f"--warmup={args.warmup}",
           f"--steps={args.steps}", f"--device={args.device}"]
    return out if args.checkpointing else [*out, "--no-checkpointing"]


def launch_row(args, cp: int, timeout_s: float, log) -> dict:
    with tempfile.TemporaryDirectory() as json_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
               os.path.abspath(__file__), "--worker", "--row-cp", str(cp), "--json-dir", json_dir, *worker_args(args)]
        env = {**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        started = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout_s)
            output, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output, rc = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), -9
        log.write(f"===== context_parallel={cp} (rc {rc}) =====\n{output}\n")
        ranks = []
        for r in range(args.gpus):
            path = os.path.join(json_dir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as fh:
                    ranks.append(json.load(fh))
    return summarise(args, cp, ranks, rc, time.perf_counter() - started)


def summarise(args, cp: int, ranks: list[dict], rc: int, wall_s: float) -> dict:
    row = {"context_parallel": cp, "data_parallel": args.gpus // cp, "rc": rc, "wall_s": wall_s}
    errors = [r["error"] for r in ranks if "error" in r]
    if rc != 0 or errors or not ranks or "step_s" not in ranks[0]:
        row["status"] = errors[0] if errors else ("killed at the budget" if rc == -9 else f"failed (rc {rc})")
        return row
    spec, tied = spec_of(args.size)
    steps = ranks[0]["step_s"]
    seconds = sum(steps) / len(steps)
    tokens = args.sequences * (args.prompt_len + args.completion_len)
    flops = update_flops(spec, num_params=ranks[0]["num_params"], tied=tied, sequences=args.sequences,
                         prompt_len=args.prompt_len, completion_len=args.completion_len)
    peaks = [r["peak_alloc_gib"] for r in ranks if r.get("peak_alloc_gib") is not None]
    row.update(status="ok", step_s=seconds, steps=steps, tokens_per_s_per_gpu=tokens / seconds / args.gpus,
               mfu=flops / seconds / args.gpus / PEAK_FLOPS, peak_alloc_gib=max(peaks) if peaks else None,
               token_budget=ranks[0]["token_budget"], num_params=ranks[0]["num_params"])
    return row


def table(rows: list[dict]) -> str:
    lines = ["| context_parallel x data_parallel | s/update | tokens/s per GPU | update MFU | peak GiB/GPU | status |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        ok = r.get("status") == "ok"
        peak = r.get("peak_alloc_gib")
        lines.append(f"| {r['context_parallel']} x {r['data_parallel']} | "
                     + (f"{r['step_s']:.2f} | {r['tokens_per_s_per_gpu']:.0f} | {100 * r['mfu']:.1f}% | "
                        if ok else "- | - | - | ")
                     + (f"{peak:.1f} | " if peak is not None else "- | ") + f"{r.get('status')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="7b", choices=[*BIG, *SIZES])
    p.add_argument("--gpus", type=int, default=4, help="ranks (GPUs) of every row")
    p.add_argument("--cp", default="4,2,1", help="train.context_parallel of each row, comma-separated")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=32768)
    p.add_argument("--token-budget", type=int, default=0, help="0: one sequence per packed row")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="train.logprob_chunk_tokens")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--out", default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row-cp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--json-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.sequences % args.gpus:
        raise SystemExit(f"--sequences {args.sequences} must split evenly over --gpus {args.gpus}")
    started, rows, walls = time.perf_counter(), [], []
    with open(args.log or os.devnull, "w") as log:
        for cp in (int(c) for c in args.cp.split(",")):
            left = args.budget_s - (time.perf_counter() - started)
            # the longest row run so far, else a default: a row that cannot finish is not started
            if args.gpus % cp or left < (max(walls) if walls else ROW_ESTIMATE_S[args.device]):
                why = f"{cp} does not divide {args.gpus} GPUs" if args.gpus % cp else "no time left in --budget-s"
                rows.append({"context_parallel": cp, "data_parallel": args.gpus // max(cp, 1), "status": why})
                continue
            row = launch_row(args, cp, left, log)
            walls.append(row["wall_s"])
            rows.append(row)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    title = (f"{args.size}, {args.sequences} x ({args.prompt_len} + {args.completion_len}) tokens, FSDP2 over "
             f"{args.gpus} x {device}, gradient checkpointing {'on' if args.checkpointing else 'off'}")
    print(f"\n{title}\n{table(rows)}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"title": title, "args": vars(args), "device": device, "rows": rows,
                       "date": time.strftime("%Y-%m-%d")}, fh, indent=1)
        record_run(f"bench/context_parallel.py: {title}", args.out, args.log)


if __name__ == "__main__":
    main()

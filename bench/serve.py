"""Generation on its own GPU (`cohort serve`) against colocated data parallel, on 2 GPUs: one table, one run.

Device command (from the repository root; one call on 2 H100s, about 5-7 minutes):

    export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false && python3 bench/serve.py --out $OUT/serve.json --log $OUT/serve.log

On 4 GPUs (`--gpus 4 --engine-gpus 1`: colocated on 4 vs 1 engine GPU + 3 data-parallel trainer GPUs, each
trainer rank pipelining its own share with max_staleness=1 in row c; `--engine-gpus 2` or `3` for more engine
replicas):

    ... && python3 bench/serve.py --gpus 4 --engine-gpus 1 --out $OUT/serve4.json --log $OUT/serve4.log

    OMP_NUM_THREADS=1 python3 bench/serve.py --device cpu --size tiny --prompts 4 --generations 4 \\
        --prompt-len 16 --completion-len 16 --warmup 1 --steps 2     # CPU smoke test of every row (gloo; one
                                                                     # thread each: server and trainer share cores)

Workload (bench/grpo_step.py's, built by its functions): the Qwen2.5-1.5B architecture with random bf16 weights,
each step --prompts prompts (default about 32 per GPU, a multiple of the colocated and of the trainer ranks: 64
on 2 GPUs as bench/scale.py, 132 on 4 with 1 engine GPU) x 8 completions, prompts of 128 random tokens,
completions of exactly 256 (ignore_eos), a length reward, one optimizer update per step, beta 0, grpo_step.py's
fast cohort settings (compiled decoder layers, token budget 8192). Every row trains the same
global batch per step:
  a) colocated   torchrun on --gpus GPUs, data parallel: each GPU generates and trains its share of the step.
  b) server      `cohort serve` on the last --engine-gpus GPUs (one replica each; --load-format dummy: the
                 trainer's first push gives it the weights), the trainer on the others (torchrun when several,
                 generation.placement=server), synchronous (train.max_staleness=0): generate on the engine
                 GPU(s), train, push the weights over NCCL, repeat.
  c) server k=1  the same with train.max_staleness=1 (one trainer process only): the next step generates while
                 this one trains.
Columns: seconds per step and steps per minute (mean over the steps after --warmup), generate (the step's wait
for its rollouts: all of generation in a and b, what is left of it after the overlap in c), update, the weight
push per step (`time/weight_push`: pack, NCCL broadcast into the server's staging copy, copy into the served
weights; 0 in a, whose engine reads the weights in place), sync (`time/sync_weights`, what the trainer waited:
the push plus, in c, the version switch waiting for the generation in flight), mean staleness, and the speed-up
over row a.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from manifest import new_run_folder, record_run  # noqa: E402
from scale import CHILD_ENV, _free_port, _kill_group, launch  # noqa: E402

ROWS = ("colocated", "server", "server-k1")


# ---------------------------------------------------------------------------------------------------------
# Worker: one trainer process (rank) of one row


def run_worker(args) -> None:
    from unittest import mock

    from grpo_step import _cohort_config, _kv_plan, build_model, build_tokenizer, length_reward, make_prompts

    import cohort.trainer
    from cohort import distributed
    from cohort.data.dataset import PromptDataset
    from cohort.rewards import RewardRunner

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = distributed.init_from_env()
    model = build_model(args.size, device)
    tok = build_tokenizer(model.config.vocab_size)
    per_rank = args.prompts // info.world_size
    plan = argparse.Namespace(size=args.size, prompts=per_rank, generations=args.generations,
                              prompt_len=args.prompt_len, completion_len=args.completion_len, warmup=args.warmup,
                              steps=args.steps, profile_update=False, token_budget=None, chunk_tokens=None,
                              mem_cap=None, compile_layers=device.type == "cuda")
    kv_fraction, budget, _ = _kv_plan(plan, model, device, lowmem=False)
    cfg = _cohort_config(plan, False, kv_fraction, budget)
    cfg.train.prompts_per_step = args.prompts
    cfg.model.compile_layers = device.type == "cuda"
    cfg.run.output_dir = args.run_dir
    if args.server:
        cfg.generation.placement, cfg.generation.server_address = "server", args.server
        cfg.generation.server_connect_timeout_s = 300.0  # the server may still be capturing its CUDA graphs
        cfg.train.max_staleness = args.staleness
    rows = [{"prompt": p} for p in make_prompts(args.prompts * cfg.train.max_steps, args.prompt_len,
                                                 model.config.vocab_size)]
    data = PromptDataset(rows, "bench").encode(tok, args.prompt_len)
    echo = print if info.is_main else (lambda *a, **k: None)
    with mock.patch.object(cohort.trainer, "_save", lambda *a, **k: None):  # no checkpoints
        comp = cohort.trainer.build_components(cfg, policy=model, tokenizer=tok, train_data=data, echo=echo,
                                               reward_runner=RewardRunner([length_reward]))
        first_push = getattr(comp.engine, "last_push", {})
        result = cohort.trainer.train(cfg, comp, echo=echo)
    if info.is_main:
        with open(args.json, "w") as fh:
            json.dump({"history": result.history, "engine": comp.engine.engine_name(), "world": info.world_size,
                       "first_push": first_push, "last_push": getattr(comp.engine, "last_push", {}),
                       "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
                      fh, default=str)
    distributed.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Parent


def _workload(args) -> list[str]:
    return ["--device", args.device, "--size", args.size, "--prompts", str(args.prompts), "--generations",
            str(args.generations), "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len),
            "--warmup", str(args.warmup), "--steps", str(args.steps)]


def _server_dir(args, work: str) -> str:
    """config.json, generation_config.json and the tokenizer: `cohort serve --load-format dummy` builds the
    architecture from them (the weights come with the trainer's first push)."""
    from grpo_step import build_model, build_tokenizer

    folder = os.path.join(work, "model")
    model = build_model(args.size, torch.device("meta"))  # the config only: no weights are made
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    build_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def _gpus(first: int, count: int) -> str:
    return ",".join(str(i) for i in range(first, first + count))


def start_server(args, work: str, log) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    # the server and the trainers share one key (`cohort serve` authenticates every request; docs/serving.md)
    os.environ.setdefault("COHORT_API_KEY", secrets.token_hex(16))
    env = {**os.environ, **CHILD_ENV}
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = _gpus(args.gpus - args.engine_gpus, args.engine_gpus)
    seqs = min(512, -(-args.prompts * args.generations // args.engine_gpus))
    cmd = [sys.executable, "-m", "cohort.cli", "serve", _server_dir(args, work), "--port", str(port),
           "--replicas", str(args.engine_gpus if args.device == "cuda" else 1),
           "--load-format", "dummy", "--device", args.device, "--max-num-seqs", str(seqs),
           "--kv-cache-fraction", "0.5", "--group-timeout-s", "300"]
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"127.0.0.1:{port}"


def run_row(args, row: str, work: str, server: str | None, deadline: float) -> dict:
    out = os.path.join(work, f"{row}.json")
    child = [os.path.abspath(__file__), "--worker", "--json", out, "--run-dir", os.path.join(work, row),
             *_workload(args)]
    trainers = args.gpus if row == "colocated" else args.gpus - args.engine_gpus
    if row != "colocated":
        child += ["--server", server, "--staleness", "1" if row == "server-k1" else "0"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(trainers)]
    cmd = [*torchrun, *child] if trainers > 1 else [sys.executable, *child]
    env_gpu = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = _gpus(0, trainers)
    try:
        status, wall = launch(cmd, deadline - time.monotonic(), os.path.join(work, f"{row}.log"))
    finally:
        if env_gpu is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_gpu
    res = {"row": row, "status": status, "wall_s": wall}
    if status == "ok" and os.path.exists(out):
        with open(out) as fh:
            res.update(json.load(fh))
        res.update(summarise(res["history"], args.warmup))
    else:
        with open(os.path.join(work, f"{row}.log")) as fh:
            res["log_tail"] = fh.read()[-3000:]
    return res


def summarise(history: list[dict], warmup: int) -> dict:
    steps = history[warmup:] or history
    mean = lambda key: sum(float(m.get(key, 0.0)) for m in steps) / len(steps)  # noqa: E731
    step_s = mean("step_time")
    return {"step_s": step_s, "steps_per_min": 60.0 / step_s, "generate_s": mean("time/generate"),
            "update_s": mean("time/update"), "push_s": mean("time/weight_push"), "sync_s": mean("time/sync_weights"),
            "staleness_mean": mean("staleness/mean"), "reward": mean("reward")}


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["row"] == "colocated" and "step_s" in r), None)
    names = {"colocated": "a) colocated DP", "server": "b) engine GPU(s) + trainer GPU(s), sync",
             "server-k1": "c) engine GPU(s) + trainer GPU(s), max_staleness=1"}
    lines = ["| row | s/step | steps/min | generate s | update s | push s | sync s | staleness | vs a |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "step_s" not in r:
            lines.append(f"| {names[r['row']]} | {r['status']} | | | | | | | |")
            continue
        speed = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        lines.append(f"| {names[r['row']]} | {r['step_s']:.2f} | {r['steps_per_min']:.1f} | {r['generate_s']:.2f} | "
                     f"{r['update_s']:.2f} | {r['push_s']:.3f} | {r['sync_s']:.3f} | {r['staleness_mean']:.2f} | {speed} |")
    return "\n".join(lines)


def parent(args) -> int:
    started = time.monotonic()
    deadline = started + args.budget_s
    work = tempfile.mkdtemp(prefix="serve_bench_")
    results: list[dict] = []
    rows = [r for r in args.rows.split(",") if r]
    server_proc = None
    log = open(args.log or os.path.join(work, "server.log"), "a")  # noqa: SIM115 (the server writes to it)
    try:
        for row in rows:
            if row != "colocated" and server_proc is None:
                server_proc, address = start_server(args, work, log)
            print(f"serve bench: row {row} ...", flush=True)
            results.append(run_row(args, row, work, address if row != "colocated" else None, deadline))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    finally:
        if server_proc is not None:
            _kill_group(server_proc, 9)
            with contextlib.suppress(Exception):
                server_proc.wait(10)
        log.close()
    print()
    print(table(results))
    device_name = next((r.get("device_name") for r in results if r.get("device_name")), args.device)
    summary = {"date": datetime.date.today().isoformat(), "device": device_name, "args": vars(args),
               "command": " ".join(sys.argv), "elapsed_s": time.monotonic() - started, "results": results,
               "table": table(results)}
    out = args.out or os.path.join(new_run_folder(f"serve-{args.gpus}gpu", summary["date"]), "serve.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
    print(f"results: {out}")
    record_run(f"bench/serve.py: cohort serve against colocated data parallel on {args.gpus} GPUs "
               f"({args.engine_gpus} for the engine), rows {args.rows}", out, args.log)
    return 0 if all("step_s" in r for r in results) else 1


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--size", default="1.5b", help="grpo_step.py's model sizes (tiny: CPU smoke test)")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of every row")
    p.add_argument("--engine-gpus", type=int, default=1, help="of them, the server's (one engine replica each)")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts per step (global; data parallel splits them; default about 32 per GPU)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="measured steps after warmup")
    p.add_argument("--rows", default=",".join(ROWS), help=f"any of {', '.join(ROWS)}")
    p.add_argument("--budget-s", type=float, default=540.0, help="every launch is killed after this long in all")
    p.add_argument("--out", default=None,
                   help="JSON (default: bench/results/<date>-serve-<gpus>gpu/serve.json, a new run folder)")
    p.add_argument("--log", default=None, help="the server's output")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--server", default=None, help=argparse.SUPPRESS)
    p.add_argument("--staleness", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.engine_gpus < args.gpus:
        p.error(f"--engine-gpus={args.engine_gpus} must leave at least one of --gpus={args.gpus} for training")
    # Every row trains the same global batch: it must split into whole prompts over the colocated row's
    # --gpus ranks and over the split rows' trainer ranks (4 GPUs, 1 engine: a multiple of 12).
    unit = math.lcm(args.gpus, args.gpus - args.engine_gpus)
    if args.prompts is None:
        args.prompts = max(unit, round(32 * args.gpus / unit) * unit)  # about 32 per GPU
    elif args.prompts % unit:
        p.error(f"--prompts={args.prompts} must split over {args.gpus} colocated ranks and "
                f"{args.gpus - args.engine_gpus} trainer ranks: choose a multiple of {unit}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

"""Weak scaling of cohort's GRPO step over GPUs (data parallel and FSDP2), a 7B FSDP row, and TRL + FSDP2 as
the baseline: one table, one run, every configuration in its own torchrun launch.

Device command (from the repository root; one 10-minute call on 4 H100s with the defaults):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false && python3 bench/scale.py --out $OUT/scale.json --log $OUT/scale.log

(.whl/ holds trl 1.16.0, datasets 5.2.0, dill 0.4.1 and multiprocess 0.70.19, from `pip download --no-deps`;
where trl or datasets does not import, the TRL row says "TRL not installed" and the others run.)

    python3 bench/scale.py --gpus 1,2 --shardings none --big-gpus 0 --no-trl --sizes tiny --device cpu \\
        --prompts 2 --generations 2 --prompt-len 8 --completion-len 8      # CPU smoke test (gloo, 2 ranks)

Rows:
  a) the workload of bench/grpo_step.py (its model, tokenizer, prompts and reward, imported from it): the
     Qwen2.5-1.5B architecture with random bf16 weights, PER GPU 32 prompts x 8 completions (so
     train.prompts_per_step = 32 x N), prompts of 128 tokens, completions of exactly 256 (ignore_eos), one
     optimizer update per step, beta 0, grpo_step.py's fast cohort settings (compiled decoder layers, token
     budget 8192, logprob chunks of 4096, KV pool of the workload x1.25); N in --gpus, for each
     train.sharding in --shardings ("none": every rank a full replica; "fsdp": FSDP2, fp32 sharded
     masters and Adam state, bf16 compute, and --fsdp-set's overrides: by default gathered weights kept from
     forward to backward and one reduce-scatter per update).
  b) the Qwen2.5-7B architecture (hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate 18944, vocab
     152064, untied embeddings) with random bf16 weights built on each rank's GPU, full fine-tuning with
     train.sharding=fsdp on --big-gpus GPUs, the same per-GPU workload (--big-prompts), a token budget of
     --big-token-budget (16384) and --big-set's overrides (gradient checkpointing by default: without it
     only ~2048-token micro-batches fit beside the engine's whole bf16 copy, and 48 micro-batches a step
     each gather and reduce-scatter the whole model).
     --big-size 32b: the Qwen2.5-32B architecture (hidden 5120, 64 layers, 40 heads, 8 KV heads, intermediate
     27648, vocab 152064, untied); --big-lora-r R trains LoRA adapters on every linear layer and
     --big-sharding none runs it data parallel (the only 32B option that fits 8 x 80 GB by cohort's
     estimate: `--estimate` prints the per-GPU table of the options without building anything; the LoRA
     rows' MFU counts 4 FLOPs per weight per token, no weight gradients). docs/benchmarks.md, "Eight GPUs".
  c) TRL's GRPOTrainer (bench/scale_trl.py) on the 1.5B workload, on the largest of --gpus, through
     `accelerate launch` with a generated config (FSDP, fsdp_version 2, bf16 mixed precision, one unit per
     decoder layer), per GPU the same 32 x 8 workload: per_device_train_batch_size 32, 8 accumulation steps
     (one optimizer step per GRPO step), no gradient checkpointing, HF generate.

Columns: seconds per step (the mean of the steps after --warmup; the slowest rank's), the generate and update
phases, the weight gather (FSDP: `time/weight_gather`, the all-gather into the engine's copy; data parallel:
`time/sync_weights`, a no-op because the engine reads the weights in place), end-to-end tokens/s per GPU
((prompt + completion) tokens of the step over all ranks / step seconds / N), the scaling efficiency (tokens/s
per GPU over the 1-GPU row of the same model and sharding), the update MFU (bench/flops.py's update FLOPs per
GPU / update seconds / 989e12, as grpo_step.py; the LM head counted on completion tokens only) and the peak allocated GiB per GPU (max over ranks, over the
training steps); generate includes scoring (cohort's `time/generate`), and for TRL it is `_generate` (tokenise +
HF generate) while its update is the step less `_prepare_inputs`, as in grpo_step_trl.py. Children get
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (NVLink multicast off) and OMP_NUM_THREADS = host
cores / the most GPUs of any row (unless set), the same host share per rank in every row. Rows run most important first (1 GPU, most GPUs, 7B, TRL, the GPU counts between); a row is skipped
when its estimated time (the longest finished row of its kind, else a default) does not fit what is left of
--budget-s (540 s by default, so that the install and the table fit a 600 s call), and every child is killed
at the budget, so the table always prints. Rows the budget left out can run in a second call, e.g.
`--gpus 2 --big-gpus 0 --no-trl --baseline-from first.json` (a copy of the first call's --out JSON in the
working tree): its 1-GPU rows are then the scaling baselines, marked with *.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # grpo_step / scale_trl live beside this file
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from flops import update_flops  # noqa: E402
from grpo_step import PEAK_FLOPS, SIZES  # noqa: E402
from manifest import record_run  # noqa: E402

BIG_SIZES = {  # untied embeddings (Qwen2.5-7B); "tiny" exercises the same code on the CPU
    "7b": {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064},
    # Qwen2.5-32B's architecture: full fine-tuning cannot fit 8 x 80 GB beside the engine's whole bf16 copy;
    # see --estimate and docs/benchmarks.md, "Eight GPUs"
    "32b": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
            "intermediate_size": 27648, "vocab_size": 152064},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1024},
}
DEFAULT_ESTIMATE_S = {"cohort": 80.0, "big": 170.0, "trl": 150.0}  # on 4 H100s, until a row of the kind ran
CPU_ESTIMATE_S = 20.0
LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPU_GIB = {"H100 80GB": 78.0, "H200 141GB": 139.0}  # free at start (the device tool's figures); 90% usable
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


# ---------------------------------------------------------------------------------------------------------
# Worker: one rank of one cohort row (under torchrun)


def _init_dist(device_kind: str) -> tuple[torch.device, int, int]:
    """Join torchrun's process group as the CLI does (cohort.distributed.init_from_env: none with one rank;
    train.sharding=fsdp then makes a world of one itself); returns (device, rank, world)."""
    from cohort import distributed

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    info = distributed.init_from_env()
    return device, info.rank, info.world_size


def build_big(size: str, device: torch.device):
    """Qwen2.5-7B's architecture (untied embeddings), random weights, built where it trains: bf16 on a GPU
    (HF's init is a normal_ per tensor there, well under a second), fp32 on the CPU."""
    from grpo_step import build_model

    return build_model(size, device, spec=BIG_SIZES[size], tie=False)


def _set_sharding(cfg, sharding: str) -> None:
    if hasattr(cfg.train, "sharding"):
        cfg.train.sharding = sharding
    elif sharding != "none":
        raise SystemExit(f"train.sharding={sharding!r}: this cohort has no train.sharding yet")


def _row_config(args, model, device, world: int):
    """grpo_step.py's fast cohort config (its KV plan for the per-GPU workload), prompts_per_step = per GPU x N."""
    from grpo_step import _cohort_config, _kv_plan

    plan = argparse.Namespace(size=args.size, prompts=args.prompts, generations=args.generations,
                              prompt_len=args.prompt_len, completion_len=args.completion_len, warmup=args.warmup,
                              steps=args.steps, profile_update=False, token_budget=args.token_budget,
                              chunk_tokens=args.chunk_tokens, mem_cap=None)
    kv_fraction, budget, info = _kv_plan(plan, model, device, lowmem=False)
    cfg = _cohort_config(plan, False, kv_fraction, budget)
    cfg.train.prompts_per_step = args.prompts * world
    cfg.run.output_dir = args.run_dir
    cfg.model.compile_layers = args.compile_layers
    cfg.generation.release_kv_during_update = args.release_kv
    _set_sharding(cfg, args.sharding)
    if args.override:
        from cohort.config import apply_overrides

        apply_overrides(cfg, args.override)
        budget = cfg.train.token_budget
    info.update(kv_cache_fraction=kv_fraction, token_budget=budget,
                logprob_chunk_tokens=cfg.train.logprob_chunk_tokens, share_prompts=cfg.train.share_prompts)
    return cfg, info


def _peaks(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_alloc_gib": None, "peak_reserved_gib": None}
    return {"peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}


def run_worker(args) -> None:
    from unittest import mock

    from grpo_step import build_model, build_tokenizer, length_reward, make_prompts

    import cohort.trainer
    from cohort.data.dataset import PromptDataset
    from cohort.rewards import RewardRunner

    started = time.perf_counter()
    device, rank, world = _init_dist(args.device)
    model = build_big(args.size, device) if args.big else build_model(args.size, device)
    num_params = sum(p.numel() for p in model.parameters())  # before any sharding: the whole model
    tok = build_tokenizer(model.config.vocab_size)
    cfg, info = _row_config(args, model, device, world)
    rows = [{"prompt": p} for p in make_prompts(cfg.train.prompts_per_step * cfg.train.max_steps, args.prompt_len,
                                                 model.config.vocab_size)]
    data = PromptDataset(rows, "bench").encode(tok, args.prompt_len)
    echo = print if rank == 0 else (lambda *a, **k: None)
    with mock.patch.object(cohort.trainer, "_save", lambda *a, **k: None):  # no checkpoints
        comp = cohort.trainer.build_components(cfg, policy=model, tokenizer=tok, train_data=data, echo=echo,
                                               reward_runner=RewardRunner([length_reward]))
        setup = {"setup_s": time.perf_counter() - started, **{f"setup_{k}": v for k, v in _peaks(device).items()}}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        profiled = contextlib.nullcontext()
        if args.profile_update and rank == 0:  # the last step's update on rank 0: where its time goes
            from grpo_step import _profile_last_update

            profiled = _profile_last_update(cfg.train.max_steps)
        with profiled:
            result = cohort.trainer.train(cfg, comp, echo=echo)
    out = {"rank": rank, "world": world, **setup, **_peaks(device), "train_s": time.perf_counter() - started}
    if rank == 0:
        import transformers

        engine = comp.engine
        out.update(history=result.history, num_params=num_params, **info,
                   engine=getattr(engine, "engine_name", lambda: type(engine).__name__)(),
                   sharding=getattr(cfg.train, "sharding", "none"), compile_layers=cfg.model.compile_layers,
                   torch=torch.__version__, transformers=transformers.__version__,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    with open(os.path.join(args.json_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh, default=str)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# --estimate: what the big row needs per GPU, by cohort's estimator (cohort.policy.memory), before any GPU is lent


def memory_plan(args) -> list[dict]:
    """Per-GPU memory estimates of the big row's options on --big-gpus GPUs, with the per-GPU workload
    (--big-prompts x --generations, --prompt-len + --completion-len), --big-token-budget, gradient
    checkpointing and a KV pool of the workload x1.25 (as grpo_step.py plans it). The estimate takes the
    arguments cohort.setup.memory_plan.plan_memory gives it for such a run on CUDA (fused logprob kernels; layers not
    compiled: compiled layers keep fewer activations, so this errs high)."""
    from cohort.config import CohortConfig
    from cohort.policy.memory import count_lora_parameters, estimate_memory
    from cohort.setup.memory_plan import micro_batch_tokens

    spec = {**BIG_SIZES[args.big_size], "tie_word_embeddings": False, "model_type": "qwen2"}
    prompts = args.big_prompts or args.prompts
    cfg = CohortConfig()  # one rank's share: micro_batch_tokens divides prompts_per_step by the (here 1) ranks
    cfg.train.prompts_per_step, cfg.train.token_budget = prompts, args.big_token_budget
    cfg.generation.num_generations, cfg.generation.max_completion_length = args.generations, args.completion_len
    cfg.data.max_prompt_length = args.prompt_len
    tokens, completion = micro_batch_tokens(cfg, args.prompt_len)
    head_dim = spec["hidden_size"] // spec["num_attention_heads"]
    kv_per_token = 2 * spec["num_hidden_layers"] * spec["num_key_value_heads"] * head_dim * 2  # bf16 K and V
    kv = int(1.25 * prompts * args.generations * (args.prompt_len + args.completion_len) * kv_per_token)
    lora_r = args.big_lora_r or 16
    lora = count_lora_parameters(spec, lora_r, list(LORA_ALL_LINEAR))
    options = [  # name, shards, master weights fp32, LoRA adapter parameters
        ("full, fp32 masters + Adam", args.big_gpus, True, 0),
        ("full, bf16 weights + Adam (train.master_weights=false)", args.big_gpus, False, 0),
        (f"LoRA r={lora_r} all-linear, frozen bf16 base sharded", args.big_gpus, True, lora),
        (f"LoRA r={lora_r} all-linear, data parallel (train.sharding=none)", None, True, lora),
    ]
    plan = []
    for name, shards, master, adapters in options:
        est = estimate_memory(spec, dtype="bf16", shards=shards, token_budget=tokens, completion_tokens=completion,
                              master_weights_fp32=master, gradient_checkpointing=True, kv_cache_bytes=kv,
                              chunk_tokens=cfg.train.logprob_chunk_tokens, lm_head_grad_fp32=master,
                              fused_logprob_kernels=True, lora_params=adapters)
        fits = {gpu: est.total <= 0.9 * gib * 2**30 for gpu, gib in GPU_GIB.items()}
        plan.append({"option": name, "sharding": "fsdp" if shards else "none", "estimate": est, "fits": fits,
                     "micro_batch_tokens": tokens})
    return plan


def memory_plan_table(plan: list[dict]) -> str:
    gib = 2**30
    gpus = list(GPU_GIB)
    head = ("| option | sharding | weights | grads + Adam | engine copy | gathered | activations + logits | KV | "
            "peak GiB/GPU | " + " | ".join(f"fits {g}" for g in gpus) + " |\n"
            "| --- | --- |" + " ---: |" * 7 + " --- |" * len(gpus))
    lines = [head]
    for row in plan:
        e = row["estimate"]
        lines.append(
            f"| {row['option']} | {row['sharding']} | {e.weights / gib:.1f} | {(e.grads + e.optimizer) / gib:.1f} | "
            f"{e.engine_weights / gib:.1f} | {e.gathered / gib:.1f} | "
            f"{(e.activations + e.logits_chunk + e.lm_head_grad) / gib:.1f} | {e.kv_cache / gib:.1f} | "
            f"{e.total / gib:.1f} | " + " | ".join("yes" if row["fits"][g] else "no" for g in gpus) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Parent: plan the rows, launch each, summarise, print


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def row_name(row: dict) -> str:
    return f"{row['size']} {row['trainer']} {row['sharding']} x{row['gpus']}"


def plan_rows(args) -> list[dict]:
    """Every row, most important first: 1 GPU, the most GPUs, the 7B row, TRL, then the GPU counts between."""
    gpus = sorted({int(g) for g in args.gpus.split(",") if g.strip()})
    shardings = [s.strip() for s in args.shardings.split(",") if s.strip()]
    order = [g for g in (gpus[:1] + gpus[-1:]) if g] + gpus[1:-1]
    order = list(dict.fromkeys(order))
    rows = []
    for size in args.sizes.split(","):
        for g in order[:2]:
            rows += [{"kind": "cohort", "trainer": "cohort", "size": size, "gpus": g, "sharding": s}
                     for s in shardings]
    if args.big_gpus:
        rows.append({"kind": "big", "trainer": "cohort", "size": args.big_size, "gpus": args.big_gpus,
                     "sharding": args.big_sharding, "lora_r": args.big_lora_r})
    if args.trl and gpus:
        rows.append({"kind": "trl", "trainer": "trl", "size": args.sizes.split(",")[0], "gpus": gpus[-1],
                     "sharding": "fsdp2 (accelerate)"})
    for size in args.sizes.split(","):
        for g in order[2:]:
            rows += [{"kind": "cohort", "trainer": "cohort", "size": size, "gpus": g, "sharding": s}
                     for s in shardings]
    return rows


def _workload_args(args, big: bool) -> list[str]:
    prompts = args.big_prompts if big and args.big_prompts else args.prompts
    return ["--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--prompts", str(prompts), "--generations", str(args.generations),
            "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)]


def row_command(args, row: dict, json_dir: str) -> list[str]:
    """The launch of one row: torchrun (cohort rows) or accelerate launch (TRL)."""
    big = row["kind"] == "big"
    if row["kind"] == "trl":
        from scale_trl import launch_command

        return launch_command(args, row["gpus"], json_dir, _workload_args(args, False), _free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(row["gpus"]),
           os.path.abspath(__file__), "--worker", "--size", row["size"], "--sharding", row["sharding"],
           "--json-dir", json_dir, "--run-dir", os.path.join(json_dir, "run"), *_workload_args(args, big),
           "--compile-layers" if args.compile_layers else "--no-compile-layers"]
    budget = args.big_token_budget if big else args.token_budget
    if budget:
        cmd += ["--token-budget", str(budget)]
    chunk = args.big_chunk_tokens if big else args.chunk_tokens
    if chunk:
        cmd += ["--chunk-tokens", str(chunk)]
    if big and args.big_release_kv:
        cmd += ["--release-kv"]
    if big and args.big_lora_r:  # every linear layer of the decoder, as the --estimate plan counts them
        cmd += ["--override", f"model.lora_r={args.big_lora_r}",
                "--override", f"model.lora_target_modules=[{','.join(LORA_ALL_LINEAR)}]"]
    if args.profile_update:
        cmd += ["--profile-update"]
    overrides = args.big_set if big else (args.fsdp_set if row["sharding"] == "fsdp" else [])
    for item in overrides or []:
        cmd += ["--override", item]
    return cmd + (["--big"] if big else [])


def launch(cmd: list[str], timeout: float, log_path: str, threads: int = 0) -> tuple[str, float]:
    """Run one launch in its own session; on timeout kill its whole process group. Returns (status, wall).
    `threads`: OMP_NUM_THREADS of every rank unless set already (the same host share per rank in every row;
    torchrun would set 1 with several ranks and leave one rank unlimited)."""
    env = {**os.environ, **CHILD_ENV}
    if threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            status = "ok" if proc.wait(timeout=max(timeout, 1.0)) == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout:.0f} s"
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
        _kill_group(proc, signal.SIGKILL)  # any worker left behind in the launch's session
    return status, time.perf_counter() - start


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


_ERROR_LINE = re.compile(r"(\w+(Error|Exception|Exit)\b|out of memory|Traceback|TRL not installed)")


def error_line(log: str) -> str:
    """The most telling line of a failed launch's log: the first rank's `cohort: rank R of W failed during
    <phase>` line, else the last exception, never torchrun's summary."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    ranks = [ln for ln in lines if re.match(r"cohort: rank \d+ of \d+ failed", ln)]
    if ranks:
        return ranks[0][:200]
    skip = ("ChildFailedError", "torch.distributed.elastic", "Traceback", "raise ", "File \"", "error_file",
            "traceback :", "To enable traceback")
    hits = [ln for ln in lines if _ERROR_LINE.search(ln) and not any(s in ln for s in skip)]
    return (hits or lines or ["failed"])[-1][:160]


def _read_ranks(json_dir: str, world: int) -> list[dict]:
    ranks = []
    for r in range(world):
        path = os.path.join(json_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as fh:
                ranks.append(json.load(fh))
    return ranks


def steps_of(rank0: dict, row: dict, args) -> list[dict]:
    """Per step: seconds (step, generate, update, weight gather) and the step's tokens over all ranks."""
    if "steps" in rank0:  # the TRL runner reports steps directly
        return rank0["steps"]
    steps, before = [], 0
    for m in rank0["history"]:
        tokens = m["num_tokens"] - before
        before = m["num_tokens"]
        gather = m.get("time/weight_gather", m.get("time/sync_weights", 0.0))
        steps.append({"step": m["step_time"], "generate": m["time/generate"], "update": m["time/update"],
                      "weight_gather": gather, "tokens": tokens,
                      "gather_metric": "time/weight_gather" if "time/weight_gather" in m else "time/sync_weights"})
    return steps


def summarise(steps: list[dict], num_params: int, gpus: int, warmup: int, *, spec: dict, tied: bool,
              prompt_len: int, completion_len: int, weight_grads: bool = True, shared: int = 1) -> dict:
    """Means over the steps after warmup and the derived rates (per GPU). The MFU counts bench/flops.py's
    update FLOPs for the step's sequences of prompt_len + completion_len tokens (the bench's exact lengths);
    weight_grads=False under LoRA (a frozen weight gets no gradient of its own); shared: completions per copy
    of their prompt (cohort's train.share_prompts, whole groups per micro-batch at the bench's lengths)."""
    steady = steps[warmup:] or steps
    n = len(steady)
    mean = {k: sum(float(s.get(k) or 0.0) for s in steady) / n for k in ("step", "generate", "update")}
    gathers = [s.get("weight_gather") for s in steady]
    mean["weight_gather"] = None if None in gathers else sum(gathers) / n
    tokens = sum(float(s["tokens"]) for s in steady) / n
    mean["tokens_per_step"] = tokens
    mean["tok_s_per_gpu"] = tokens / mean["step"] / gpus
    flops = update_flops(spec, num_params=num_params, tied=tied, sequences=tokens / (prompt_len + completion_len),
                         prompt_len=prompt_len, completion_len=completion_len, weight_grads=weight_grads,
                         shared=shared)
    mean["mfu"] = flops / gpus / mean["update"] / PEAK_FLOPS if mean["update"] else None
    mean["measured_steps"] = n
    return mean


def run_row(args, row: dict, timeout: float, work: str) -> dict:
    json_dir = tempfile.mkdtemp(prefix=row_name(row).replace(" ", "_").replace("(", "").replace(")", "") + "_",
                                dir=work)
    if row["kind"] == "trl" and not _trl_importable():
        return {**row, "status": "TRL not installed", "error": "TRL not installed", "wall_s": 0.0}
    log_path = os.path.join(json_dir, "log.txt")
    status, wall = launch(row_command(args, row, json_dir), timeout, log_path, threads=getattr(args, "threads", 0))
    with open(log_path, errors="replace") as fh:
        log = fh.read()
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(f"\n===== {row_name(row)}: {status}, {wall:.0f} s =====\n{log}")
    ranks = _read_ranks(json_dir, row["gpus"])
    res = {**row, "status": status, "wall_s": wall, "ranks": [{k: v for k, v in r.items() if k != "history"}
                                                               for r in ranks]}
    rank0 = next((r for r in ranks if r.get("rank") == 0 and ("history" in r or "steps" in r)), None)
    if status != "ok" or rank0 is None:
        res["error"] = status if "timeout" in status else error_line(log)
        tail = "\n".join(log.strip().splitlines()[-12:])
        print(f"    {row_name(row)} failed ({status}); log tail:\n{tail}", flush=True)
        return res
    if row["kind"] == "trl":  # what accelerate actually did (on the CPU it runs DDP, not FSDP)
        version = rank0.get("fsdp_version")
        res["sharding"] = f"fsdp{version} (accelerate)" if version else f"{str(rank0.get('distributed_type')).split('.')[-1]} (no FSDP)"
    res["steps"] = steps_of(rank0, row, args)
    res["history"] = rank0.get("history")
    res["num_params"] = rank0["num_params"]
    big = row["kind"] == "big"
    res["summary"] = summarise(res["steps"], rank0["num_params"], row["gpus"], args.warmup,
                               spec=(BIG_SIZES if big else SIZES)[row["size"]], tied=not big,
                               prompt_len=args.prompt_len, completion_len=args.completion_len,
                               weight_grads=not row.get("lora_r"),
                               shared=args.generations if rank0.get("share_prompts") else 1)
    peaks = [r["peak_alloc_gib"] for r in ranks if r.get("peak_alloc_gib") is not None]
    res["summary"]["peak_alloc_gib"] = max(peaks) if peaks else None
    res["summary"]["ranks_reported"] = len(ranks)
    return res


def _trl_importable() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))


def _estimate(kind: str, done: list[dict], device: str) -> float:
    walls = [r["wall_s"] for r in done if r["kind"] == kind and r.get("summary")]
    if walls:
        return 1.15 * max(walls)
    return DEFAULT_ESTIMATE_S[kind] if device == "cuda" else CPU_ESTIMATE_S


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _label(row: dict) -> tuple[str, str]:
    size = row["size"].upper() if row["size"][0].isdigit() else row["size"]
    if row["kind"] == "big" and not row["size"][0].isdigit():
        size += " (untied)"
    trainer = "TRL GRPOTrainer" if row["trainer"] == "trl" else "cohort"
    if row.get("lora_r"):
        trainer += f" (LoRA r={row['lora_r']})"
    return size, trainer


def fmt_row(res: dict, base: dict | None, mark: str = "") -> str:
    size, trainer = _label(res)
    head = f"| {size} | {trainer} | {res['gpus']} | {res['sharding']} |"
    s = res.get("summary")
    if not s:
        why = res.get("error") or res.get("status", "?")
        label = "not run" if why.startswith(("skipped", "TRL not installed")) else "failed"
        return f"{head} {label}: {why[:120].replace('|', '/')} |" + " |" * 7
    eff = None
    if base and base.get("summary"):
        eff = s["tok_s_per_gpu"] / base["summary"]["tok_s_per_gpu"]
    mfu = None if s["mfu"] is None else 100 * s["mfu"]
    return (f"{head} {s['step']:.2f} | {s['generate']:.2f} | {s['update']:.2f} | {_fmt(s['weight_gather'], '.3f')} | "
            f"{s['tok_s_per_gpu'] / 1e3:.1f}k | {_fmt(None if eff is None else 100 * eff, '.0f', '%' + mark)} | "
            f"{_fmt(mfu, '.1f', '%')} | {_fmt(s['peak_alloc_gib'], '.2f')} |")


def _baseline(res: dict, results: list[dict], previous: list[dict]) -> tuple[dict | None, bool]:
    """The 1-GPU row of the same model and sharding: from this run, else from --baseline-from's (flagged)."""
    def find(rows):
        return next((b for b in rows if b["kind"] == "cohort" and b["gpus"] == 1 and b.get("summary")
                     and b["size"] == res["size"] and b["sharding"] == res["sharding"]), None)

    if res["kind"] != "cohort":
        return None, False
    here = find(results)
    return (here, False) if here else (find(previous), True)


def table(results: list[dict], previous: list[dict] | None = None) -> str:
    head = ("| model | trainer | GPUs | sharding | s/step | generate | update | weight gather (s) | "
            "tokens/s per GPU | scaling eff. | update MFU | peak alloc GiB/GPU |\n"
            "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rank = {"cohort": 0, "big": 1, "trl": 2}
    shard = {"none": 0, "fsdp": 1}
    ordered = sorted(results, key=lambda r: (rank[r["kind"]], r["size"], shard.get(r["sharding"], 2), r["gpus"]))
    lines, flagged = [], False
    for res in ordered:
        base, old = _baseline(res, results, previous or [])
        flag = old and base is not None and bool(res.get("summary"))
        flagged = flagged or flag
        lines.append(fmt_row(res, base, "*" if flag else ""))
    note = ["", "* scaling efficiency against the 1-GPU row of --baseline-from (an earlier run)"] if flagged else []
    return "\n".join([head, *lines, *note])


def load_previous(path: str | None) -> list[dict]:
    if not path:
        return []
    with open(path) as fh:
        return [r for r in json.load(fh)["results"] if r.get("summary")]


def parent(args) -> int:
    started = time.monotonic()
    deadline = started + args.budget_s
    work = tempfile.mkdtemp(prefix="cohort_scale_")
    rows = plan_rows(args)
    args.threads = max(1, (os.cpu_count() or 1) // max([r["gpus"] for r in rows] or [1]))
    say = lambda msg: print(f"[scale +{time.monotonic() - started:5.0f} s] {msg}", flush=True)  # noqa: E731
    say(f"{len(rows)} rows: " + "; ".join(row_name(r) for r in rows))
    results: list[dict] = []
    for row in rows:
        left = deadline - time.monotonic()
        need = _estimate(row["kind"], results, args.device)
        if need > left:
            say(f"skip {row_name(row)}: needs ~{need:.0f} s, {left:.0f} s of --budget-s left")
            results.append({**row, "status": "skipped", "error": f"skipped (~{need:.0f} s > {left:.0f} s left)",
                            "wall_s": 0.0})
            continue
        timeout = min(args.child_timeout_s, left)
        say(f"start {row_name(row)} (timeout {timeout:.0f} s)")
        res = run_row(args, row, timeout, work)
        results.append(res)
        s = res.get("summary")
        if s:
            say(f"done  {row_name(row)} in {res['wall_s']:.0f} s: {s['step']:.2f} s/step, generate "
                f"{s['generate']:.2f}, update {s['update']:.2f}, {s['tok_s_per_gpu'] / 1e3:.1f}k tok/s/GPU, "
                f"peak {_fmt(s['peak_alloc_gib'], '.2f')} GiB")
        else:
            say(f"fail  {row_name(row)} after {res['wall_s']:.0f} s: {res.get('error')}")
    print("\n" + table(results, load_previous(args.baseline_from)), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "elapsed_s": time.monotonic() - started, "results": results}, fh,
                      indent=1, default=str)
        record_run(f"bench/scale.py: the GRPO step over {args.gpus or 'no'} GPUs (weak scaling)", args.out, args.log)
    return 0


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2,4", help="GPU counts of the weak-scaling rows")
    p.add_argument("--shardings", default="none,fsdp", help="train.sharding values of the weak-scaling rows")
    p.add_argument("--sizes", default="1.5b", help="model of the weak-scaling rows (tiny: CPU smoke test)")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--big-gpus", type=int, default=None, help="GPUs of the 7B FSDP row (0: no such row; "
                   "default 4 on CUDA, 0 on the CPU)")
    p.add_argument("--big-size", default=None, choices=sorted(BIG_SIZES), help="default 7b (tiny on the CPU)")
    p.add_argument("--big-prompts", type=int, default=None, help="7B row: prompts per GPU (default --prompts)")
    p.add_argument("--big-token-budget", type=int, default=16384, help="7B row: train.token_budget")
    p.add_argument("--big-set", action="append", default=None,
                   help="7B row: a config override KEY=VALUE (repeatable; default model.gradient_checkpointing=true, "
                        "which lets 16384-token micro-batches fit: 6 per step instead of 48, so 8x fewer FSDP "
                        "gathers and reduce-scatters)")
    p.add_argument("--fsdp-set", action="append", default=None,
                   help="1.5B fsdp rows: a config override KEY=VALUE (repeatable; default "
                        "train.fsdp_reshard_after_forward=false and train.fsdp_reduce_every_micro_batch=false: "
                        "one all-gather per micro-batch and one reduce-scatter per update, which fits at 1.5B)")
    p.add_argument("--big-sharding", default="fsdp", choices=("fsdp", "none"),
                   help="the big row's train.sharding (none: data parallel, the engine reads the weights in place)")
    p.add_argument("--big-lora-r", type=int, default=0,
                   help="the big row trains LoRA adapters of this rank on every linear layer (0: full fine-tuning)")
    p.add_argument("--estimate", action="store_true",
                   help="print cohort's per-GPU memory estimate of the big row's options (full fine-tuning with "
                        "fp32 or bf16 masters, LoRA with FSDP or data parallel) for --big-size on --big-gpus GPUs, "
                        "and exit: a CPU dry run, no model is built")
    p.add_argument("--big-chunk-tokens", type=int, default=None, help="7B row: train.logprob_chunk_tokens")
    p.add_argument("--big-release-kv", action=argparse.BooleanOptionalAction, default=False,
                   help="7B row: generation.release_kv_during_update (frees the KV pool during the update)")
    p.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True,
                   help="the TRL + FSDP2 row on the largest of --gpus")
    p.add_argument("--trl-micro-batch", type=int, default=32, help="TRL per_device_train_batch_size")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="measured steps after warmup")
    p.add_argument("--prompts", type=int, default=32, help="prompts per GPU per step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=None, help="1.5B rows (default grpo_step.py's fast row)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="1.5B rows: train.logprob_chunk_tokens")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=cuda,
                   help="cohort rows: model.compile_layers")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no row that would end after this long")
    p.add_argument("--child-timeout-s", type=float, default=240.0, help="kill a row's launch after this long")
    p.add_argument("--baseline-from", default=None,
                   help="an earlier --out JSON whose 1-GPU rows are the scaling baselines this run lacks "
                        "(e.g. a second call with --gpus 2)")
    p.add_argument("--out", default=None, help="JSON with every step of every row")
    p.add_argument("--log", default=None, help="append every launch's output here")
    # worker side (set by the parent)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--sharding", default="none", help=argparse.SUPPRESS)
    p.add_argument("--json-dir", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--big", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--release-kv", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--override", action="append", default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-update", action="store_true",
                   help="print rank 0's profile of the last step's update (torch.profiler, top kernels)")
    args = p.parse_args(argv)
    if args.big_set is None:
        args.big_set = ["model.gradient_checkpointing=true"]
    if args.fsdp_set is None:
        args.fsdp_set = ["train.fsdp_reshard_after_forward=false", "train.fsdp_reduce_every_micro_batch=false"]
    if args.big_gpus is None:
        args.big_gpus = 4 if args.device == "cuda" else 0
    if args.big_size is None:
        args.big_size = "7b" if args.device == "cuda" else "tiny"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.estimate:
        print(memory_plan_table(memory_plan(args)))
        return 0
    if args.worker:
        run_worker(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

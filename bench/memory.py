"""cohort's memory estimate against the measured peak, one row per run, each run in its own process.

    python bench/memory.py                          # CPU rows: the default job and a TRL-facade run
    python bench/memory.py --rows gpu               # GPU rows: recipes/chain_sum_gpu.yaml and the
                                                    # bench/grpo_step.py cohort rows (0.5B / 1.5B, fast / low memory)
    python bench/memory.py --rows default,fast-0.5b --steps 2

What is compared. The estimate is the table cohort prints at start (`Components.memory_estimate`: weights,
gradients, master weights, Adam moments, activations of one micro-batch, one logprob chunk, the LM-head
gradient sum, the engine's KV pool and fused weight copies, the reference model). The measured peak is the
memory the run added for all of that:
- on a GPU, `torch.cuda.max_memory_allocated()` over the whole run (model load, setup, every step; nothing
  else lives on the device), with `max_memory_reserved()` beside it (the allocator's cache on top);
- on the CPU, the process's peak resident set (`ru_maxrss`) minus its resident set just before the model is
  loaded (after importing torch, transformers and cohort), so interpreter and libraries are not counted.
  A thread samples the resident set every 5 ms to tell which phase (load, generate, update, save) peaked.
Every completion runs to max_completion_length (generation.ignore_eos; bench/grpo_step.py's rows do so
anyway): the step the estimate sizes. --natural lets them end at EOS as sampled, to see how far a real run
lands from it. A row is within the issue's bar when |estimate / peak - 1| <= 25%.

Rows. `default`: recipes/default.yaml with train.max_steps=--steps (the held-out evals and the final
checkpoint included). `facade`: cohort's GRPOTrainer with TRL's defaults (gradient checkpointing, 512-token
completions, 8 completions per step) on SmolLM2-135M-Instruct and 16 chain_sum prompts, --steps steps.
`chain_sum_gpu`: recipes/chain_sum_gpu.yaml, --steps steps. `fast-0.5b`, `lowmem-0.5b`, `fast-1.5b`,
`lowmem-1.5b`: bench/grpo_step.py's cohort rows with its defaults (32 prompts x 8 completions of 128 + 256
tokens; the low-memory rows under the TRL peaks docs/benchmarks.md measured: 4.99 / 13.30 GiB). `fast-tiny`,
`lowmem-tiny`: the same code path on its tiny CPU smoke-test model (a check of the script, not a measurement).
`lora-0.5b`: the fast 0.5B row with LoRA adapters of rank 16 on every linear layer (model.lora_r=16).
`long-0.5b`: the fast 0.5B row at 16 prompts x 4 completions of 256 + 4,096 tokens.

Rows not used to fit the estimate (its GPU activation term was fitted on the compiled fast rows): lowmem-1.5b,
lora-0.5b and long-0.5b. tests/gpu/test_memory_estimate_gpu.py runs those three and holds each within 25%.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
CPU_ROWS = ("default", "facade")
GPU_ROWS = ("chain_sum_gpu", "fast-0.5b", "lowmem-0.5b", "fast-1.5b", "lowmem-1.5b", "lora-0.5b", "long-0.5b")
HELD_OUT_ROWS = ("lowmem-1.5b", "lora-0.5b", "long-0.5b")  # never used to fit the estimate's terms
LORA_RANK = 16
TRL_PEAK_GIB = {"0.5b": 4.99, "1.5b": 13.30}  # docs/benchmarks.md, the low-memory rows' cap
GIB = 2**30


# ---------------------------------------------------------------------------------------------------------
# Child: one run, its estimate and its peak


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Sampler:
    """Resident set sampled every 20 ms; the peak of each phase (the phase is set by wrapped functions)."""

    def __init__(self):
        self.phase, self.peaks, self._stop = "setup", {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss = _rss()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(0.02)

    def wrap(self, phase: str, fn):
        def wrapped(*a, **k):
            before, self.phase = self.phase, phase
            try:
                return fn(*a, **k)
            finally:
                self.phase = before
        return wrapped

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _capture_components(stack: ExitStack, sampler: _Sampler | None) -> dict:
    """Patch build_components wherever it is called so the run's Components (and its estimate) are kept; on the
    CPU also label the phases of the run for the sampler."""
    import cohort.setup
    import cohort.trainer

    seen: dict = {}
    original = cohort.setup.build_components

    def build(*a, **k):
        comp = original(*a, **k)
        seen["comp"] = comp
        if sampler is not None:
            comp.engine.generate = sampler.wrap("generate", comp.engine.generate)
        return comp

    stack.enter_context(mock.patch.object(cohort.setup, "build_components", build))
    stack.enter_context(mock.patch.object(cohort.trainer, "build_components", build))
    if sampler is not None:
        from cohort.update import PolicyUpdater

        stack.enter_context(mock.patch.object(PolicyUpdater, "update", sampler.wrap("update", PolicyUpdater.update)))
        stack.enter_context(mock.patch.object(cohort.trainer, "_save", sampler.wrap("save", cohort.trainer._save)))
        import cohort.policy.model

        stack.enter_context(mock.patch.object(cohort.policy.model, "load_policy",
                                              sampler.wrap("load", cohort.policy.model.load_policy)))
        import cohort.setup.policy

        stack.enter_context(mock.patch.object(cohort.setup.policy, "load_policy",
                                              sampler.wrap("load", cohort.setup.policy.load_policy)))
    return seen


def _run_recipe(recipe: str, steps: int, extra: list[str]) -> None:
    from cohort.config import load_config
    from cohort.trainer import train

    out = tempfile.mkdtemp(prefix="memory_bench_")
    cfg = load_config(str(ROOT / recipe), [f"train.max_steps={steps}", f"run.output_dir={out}", *extra])
    train(cfg, echo=lambda *a: None)


def _run_facade(steps: int, natural: bool) -> None:
    from datasets import Dataset

    from cohort import GRPOConfig, GRPOTrainer
    from cohort.data import load_prompt_dataset

    rows = load_prompt_dataset("reasoning_gym:chain_sum", size=16, seed=1, conversational=True).rows
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="memory_bench_"), max_steps=steps, report_to=[],
                      save_strategy="no", logging_steps=1, extra={} if natural else {"generation.ignore_eos": True})
    trainer = GRPOTrainer(model="smollm2-135m-instruct", reward_funcs=_length_reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]))
    trainer.train()


def _length_reward(completions, **kwargs) -> list[float]:
    """Any reward does: the memory does not depend on it."""
    return [len(str(c)) / 100.0 for c in completions]


def _run_grpo_step(row: str, steps: int, device: str) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import grpo_step

    kind, size = row.split("-")
    lowmem = kind == "lowmem"
    # "tiny" (bench/grpo_step.py's CPU smoke-test size): a quick check of this path, not a measurement
    shape = {"prompts": 4, "generations": 4, "prompt_len": 16, "completion_len": 16} if size == "tiny" else {
        "prompts": 32, "generations": 8, "prompt_len": 128, "completion_len": 256}
    if kind == "long":
        shape = {"prompts": 16, "generations": 4, "prompt_len": 256, "completion_len": 4096} if size != "tiny" else {
            "prompts": 2, "generations": 2, "prompt_len": 16, "completion_len": 64}
    if kind == "lora":
        _with_lora(grpo_step)
    args = argparse.Namespace(
        size=size, device=device, warmup=0, steps=steps, **shape, token_budget=None, chunk_tokens=None,
        lowmem_token_budget=None, lowmem_chunk_tokens=256, lowmem_release_kv=True, lowmem_offload=device == "cuda",
        mem_cap=int(TRL_PEAK_GIB[size] * GIB) if lowmem and size in TRL_PEAK_GIB else None,
        compile_layers=device == "cuda", profile_update=False, profile_generate=False)
    grpo_step.run_cohort(args, lowmem=lowmem)


def _with_lora(grpo_step) -> None:
    """Make bench/grpo_step.py's config build a LoRA run (rank LORA_RANK on every linear layer)."""
    plain = grpo_step._cohort_config

    def lora_config(*a, **k):
        cfg = plain(*a, **k)
        cfg.model.lora_r = LORA_RANK  # the default targets: every linear layer of the decoder
        return cfg

    grpo_step._cohort_config = lora_config


def child(row: str, steps: int, out: str, natural: bool) -> None:
    import torch

    import cohort.setup  # imported before the baseline: libraries are not part of the peak
    import cohort.trainer  # noqa: F401

    cuda = row not in CPU_ROWS and (torch.cuda.is_available() or not row.endswith("-tiny"))
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"row {row} needs a GPU")
    # every completion at max_completion_length: the micro-batch the estimate sizes (--natural: as sampled)
    max_length = [] if natural else ["generation.ignore_eos=true"]
    baseline = _rss()
    with ExitStack() as stack:
        sampler = None if cuda else stack.enter_context(_Sampler())
        seen = _capture_components(stack, sampler)
        start = time.perf_counter()
        if row == "default":  # no held-out evals: they only generate, in the same KV pool
            _run_recipe("recipes/default.yaml", steps, ["data.eval_size=0", *max_length])
        elif row == "facade":
            _run_facade(steps, natural)
        elif row == "chain_sum_gpu":
            _run_recipe("recipes/chain_sum_gpu.yaml", steps, ["run.eval_steps=0", "data.eval_size=0", *max_length])
        else:
            _run_grpo_step(row, steps, "cuda" if cuda else "cpu")
        wall = time.perf_counter() - start
    est = seen["comp"].memory_estimate
    result = {"row": row, "device": "cuda" if cuda else "cpu", "wall_s": wall,
              "estimate": {k: v / GIB for k, v in est.terms.items()}, "estimate_gib": est.total / GIB}
    if cuda:
        result.update(peak_gib=torch.cuda.max_memory_allocated() / GIB,
                      reserved_gib=torch.cuda.max_memory_reserved() / GIB,
                      device_name=torch.cuda.get_device_name())
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        result.update(peak_gib=(peak - baseline) / GIB, baseline_gib=baseline / GIB,
                      phase_peaks_gib={k: (v - baseline) / GIB for k, v in sampler.peaks.items()})
    with open(out, "w") as fh:
        json.dump(result, fh)


# ---------------------------------------------------------------------------------------------------------
# Parent: every row in a subprocess, then the table


def _table(results: list[dict]) -> str:
    lines = ["| row | device | estimate GiB | measured peak GiB | estimate / peak | within 25% | biggest terms (GiB) |",
             "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | - | - | - | - | failed: {r['error'][:80]} | |")
            continue
        ratio = r["estimate_gib"] / r["peak_gib"] if r["peak_gib"] > 0 else float("nan")
        terms = sorted(((v, k) for k, v in r["estimate"].items() if v > 0.01), reverse=True)[:4]
        note = ", ".join(f"{k} {v:.2f}" for v, k in terms)
        peak = f"{r['peak_gib']:.2f}" + (f" (reserved {r['reserved_gib']:.2f})" if "reserved_gib" in r else "")
        lines.append(f"| {r['row']} | {r.get('device_name', r['device'])} | {r['estimate_gib']:.2f} | {peak} | "
                     f"{ratio:.2f} | {'yes' if abs(ratio - 1) <= 0.25 else 'NO'} | {note} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="cpu", help="comma list of rows, or 'cpu' / 'gpu' for a device's rows")
    p.add_argument("--steps", type=int, default=2, help="training steps per run")
    p.add_argument("--natural", action="store_true",
                   help="completions end at EOS as sampled (default: every completion at max_completion_length, "
                        "the worst case the estimate is for)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per row")
    p.add_argument("--out", default=None, help="write every row's JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.steps, args.json, args.natural)
    rows = {"cpu": list(CPU_ROWS), "gpu": list(GPU_ROWS)}.get(args.rows) or args.rows.split(",")
    results = []
    for row in rows:
        out = tempfile.mktemp(suffix=".json")
        cmd = [sys.executable, __file__, "--child", row, "--steps", str(args.steps), "--json", out]
        cmd += ["--natural"] if args.natural else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, cwd=ROOT)
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            log = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {args.timeout_s:.0f} s"
        if os.path.exists(out):
            with open(out) as fh:
                res = json.load(fh)
            print(f"[{row}] {json.dumps(res)}", flush=True)
        else:
            tail = log.strip().splitlines()[-12:]
            print(f"[{row}] FAILED:\n" + "\n".join(tail), flush=True)
            res = {"row": row, "error": tail[-1] if tail else "failed"}
        results.append(res)
    print("\n" + _table(results), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
        from manifest import record_run  # bench/'s helper (the script's folder is on sys.path)

        record_run(f"bench/memory.py: cohort's memory estimate against the measured peak, rows {args.rows}", args.out)


if __name__ == "__main__":
    main()

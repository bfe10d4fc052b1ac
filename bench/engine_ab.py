"""A/B of engine settings on workload A and B in one process (one GPU): prefill graphs on/off, the decode
attention's loop tile; with --sampler-cdf instead, the sampler's inverse-CDF pass against the Gumbel pass
(triton_ops.SAMPLER_PASS), alternated twice to show the run-to-run spread; with --step-kernel, the multi-step
loop's bookkeeping as one kernel per step (engine/triton_step.py) against the PyTorch operations, alternated
twice, then the kernel with the inverse-CDF pass twice. Each row: median
wall of 3 runs of engine.generate after a warm-up, and the engine loop's prefill time (engine.step of the
prefill, synchronised).

    PYTHONPATH=src:. python3 bench/engine_ab.py [--sampler-cdf | --step-kernel | --sampler-load | --decode-steps 8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rollout import build_model, run_engine_mixed, workload_a  # bench/ is the script's folder, so on sys.path

from cohort.engine import CohortEngine, triton_ops, triton_step
from cohort.types import SamplingParams


def wall(engine, prompts, params, repeats: int = 3) -> float:
    engine.generate(prompts, params)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill_ms(engine, prompts, params) -> float:
    for i, p in enumerate(prompts):
        engine._add(i, p, params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0)
    while engine.scheduler.has_work():
        engine.step()
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sampler-cdf", action="store_true", help="A/B the sampler's inverse-CDF pass instead")
    p.add_argument("--step-kernel", action="store_true",
                   help="A/B the multi-step loop's bookkeeping kernel against the PyTorch operations instead")
    p.add_argument("--sampler-load", action="store_true",
                   help="A/B the Gumbel pass reading unfiltered rows once against twice (triton_ops.SAMPLER_ONE_LOAD)")
    p.add_argument("--decode-steps", default=None,
                   help="A/B decode steps per graph instead, e.g. 8,16 (each value twice, alternated)")
    args = p.parse_args()
    model = build_model()
    prompts = workload_a(model.config.vocab_size)
    params = SamplingParams(n=8, max_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
    original, original_pass = triton_ops.decode_tile, triton_ops.SAMPLER_PASS
    rows = (("prefill graphs, tile 128/4", 4096, None, "gumbel", True),
            ("eager prefill, tile 128/4", 0, None, "gumbel", True),
            ("prefill graphs, tile 64/3", 4096, (64, 3), "gumbel", True),
            ("eager prefill, tile 64/3", 0, (64, 3), "gumbel", True))
    if args.sampler_cdf:
        rows = tuple((f"{method} sampler pass{' again' if i >= 2 else ''}", 4096, None, method, True)
                     for i, method in enumerate(("gumbel", "cdf") * 2))
    if args.step_kernel:
        settings = ((False, "gumbel"), (True, "gumbel")) * 2 + ((True, "cdf"),) * 2
        rows = tuple((f"{'step kernel' if kernel else 'PyTorch bookkeeping'}, {method} sampler"
                      f"{' again' if (kernel, method) in settings[:i] else ''}", 4096, None, method, kernel)
                     for i, (kernel, method) in enumerate(settings))
    one_load = {}
    if args.sampler_load:
        rows = tuple((f"Gumbel pass, rows read {'once' if once else 'twice'}{' again' if i >= 2 else ''}", 4096, None,
                      "gumbel", True) for i, once in enumerate((False, True) * 2))
        one_load = {row[0]: "once" in row[0] for row in rows}
    steps_of = {}
    if args.decode_steps:
        values = [int(v) for v in args.decode_steps.split(",")] * 2
        rows = tuple((f"decode_steps={v}{' again' if v in values[:i] else ''}", 4096, None, "gumbel", True)
                     for i, v in enumerate(values))
        steps_of = {row[0]: v for row, v in zip(rows, values)}
    print("| setting | A tok/s | A prefill ms | B tok/s |\n| --- | ---: | ---: | ---: |")
    for name, graph_tokens, tile, method, kernel in rows:
        triton_ops.decode_tile = original if tile is None else (lambda head_dim, t=tile: t)
        triton_ops.SAMPLER_PASS, triton_step.USE_KERNEL = method, kernel
        triton_ops.SAMPLER_ONE_LOAD = one_load.get(name, True)
        engine = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256,
                              prefill_graph_tokens=graph_tokens, decode_steps=steps_of.get(name))
        seconds = wall(engine, prompts, params)
        pre = statistics.median(prefill_ms(engine, prompts, params) for _ in range(3))
        run_engine_mixed(engine, model.config.vocab_size)
        b_tok_s = run_engine_mixed(engine, model.config.vocab_size)[0]
        print(f"| {name} | {256 * 256 / seconds:,.0f} | {pre:.1f} | {b_tok_s:,.0f} |", flush=True)
        del engine
        torch.cuda.empty_cache()
    triton_ops.decode_tile, triton_ops.SAMPLER_PASS, triton_step.USE_KERNEL = original, original_pass, True
    triton_ops.SAMPLER_ONE_LOAD = True


if __name__ == "__main__":
    main()

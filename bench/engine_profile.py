"""Where a decode step's time goes: graph replay, sampler kernel, host-side work (one GPU).

    python bench/engine_profile.py [--trace-dir DIR]

Times (median of repeats, CUDA events) at batch 256, Qwen2.5-0.5B architecture with random bf16 weights:
the captured decode graph alone, the fused sampler alone, the paged-attention kernel alone, and the host
side of the engine's step (scheduling, input preparation, appending tokens) measured on the real loop.
First the decode attention's loop tile, warps and stages on workload-A-like block tables (--attention-only
stops there; --sampler-passes times only the Gumbel and inverse-CDF sampler passes). Then the sampler's
slicing variants and the decode matmuls (cuBLAS vs cuBLASLt) timed as CUDA graphs (no
launch overhead), and workloads A and B through `engine.generate` under torch.profiler: the device timeline's
busy time and idle gaps (trace_gaps.py; the Chrome traces saved under --trace-dir).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import trace_gaps
from rollout import build_model, run_engine_mixed, workload_a  # bench/ is the script's folder, so on sys.path


def gpu_ms(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(fn, repeats: int = 20, inner: int = 10) -> float:
    """Median ms of one call of `fn` captured `inner` times in a CUDA graph (kernel time, no launch cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return gpu_ms(graph.replay, repeats) / inner


def sampler_table(vocab: int) -> None:
    """The sliced sampler against one program per row (splits=1, the kernel before slicing) at 256 rows."""
    from cohort.engine.triton_ops import fused_sample, sample_splits

    rows = 256
    seeds = torch.randint(0, 2**62, (rows,), device="cuda")
    positions = torch.randint(0, 2048, (rows,), device="cuda")
    inv_t, noise = torch.ones(rows, device="cuda"), torch.ones(rows, device="cuda")
    fake = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    default = sample_splits(rows, vocab)
    variants = ((1, 2048, 8, False), (default, 2048, 8, False), (default, 2048, 8, True), (16, 1024, 4, True),
                (default, 1024, 4, True), (4, 2048, 8, True), (4, 1024, 4, True))
    for splits, block, warps, fast in variants:
        ms = graph_ms(lambda s=splits, b=block, w=warps, f=fast: fused_sample(
            fake, fake, inv_t, noise, seeds, positions, splits=s, block_v=b, num_warps=w, fast_log=f))
        tag = " (default)" if (splits, block, warps, fast) == (default, 1024, 4, True) else ""
        print(f"sampler {rows} x {vocab}, splits {splits}, block {block}, {warps} warps, "
              f"{'fast' if fast else 'accurate'} log: {ms * 1000:.1f} us{tag}")


def sampler_pass_table(vocab: int = 151936) -> None:
    """The Gumbel pass against the inverse-CDF pass (triton_cdf), default slicing, as CUDA graphs, at the row
    counts of a decode batch and its tail."""
    from cohort.engine.triton_ops import fused_sample

    print("| rows | gumbel us | cdf us |\n| ---: | ---: | ---: |")
    for rows in (256, 128, 64, 16, 1):
        seeds = torch.randint(0, 2**62, (rows,), device="cuda")
        positions = torch.randint(0, 2048, (rows,), device="cuda")
        inv_t, noise = torch.ones(rows, device="cuda"), torch.ones(rows, device="cuda")
        fake = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
        args = (fake, fake, inv_t, noise, seeds, positions)
        us = [graph_ms(lambda m=m, a=args: fused_sample(*a, method=m)) * 1000 for m in ("gumbel", "cdf")]
        print(f"| {rows} | {us[0]:.1f} | {us[1]:.1f} |", flush=True)


def matmul_table(cfg, rows: int = 256) -> None:
    """The decode step's matmuls at `rows` rows (fused QKV and gate/up as the engine runs them), cuBLAS vs
    cuBLASLt (torch.backends.cuda.preferred_blas_library), each timed as a CUDA graph."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"qkv": (h, q + 2 * kv), "o_proj": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h),
              "lm_head": (h, cfg.vocab_size)}
    print(f"| decode matmul, M = {rows} | K x N | cuBLAS us | cuBLASLt us |\n| --- | --- | ---: | ---: |")
    for name, (k, n) in shapes.items():
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        times = []
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            times.append(graph_ms(lambda x=x, w=w: x @ w.t()) * 1000)
        torch.backends.cuda.preferred_blas_library("cublas")
        print(f"| {name} | {k} x {n} | {times[0]:.1f} | {times[1]:.1f} |")


def a_like_tables(rows: int, ctx: int, block: int, width: int, num_blocks: int, group: int = 8,
                  prefix_blocks: int = 2) -> torch.Tensor:
    """Block tables laid out as workload A's: each group of `group` rows shares its prompt's first
    `prefix_blocks` blocks, every other block is the row's own, all distinct and scattered over the pool."""
    need = -(-ctx // block)
    perm = torch.randperm(num_blocks - 1, device="cuda")[: rows * need].view(rows, need).to(torch.int32) + 1
    perm[:, :prefix_blocks] = perm[::group, :prefix_blocks].repeat_interleave(group, 0)[:rows]
    tables = torch.zeros(rows, width, device="cuda", dtype=torch.int32)
    tables[:, :need] = perm
    return tables


def standalone_caches(kv_heads: int, head_dim: int, block: int = 64, num_blocks: int = 8192):
    """Separate K and V caches of one layer, as the engine lays them out (a scratch block at the end)."""
    shape = (num_blocks + 1, block, kv_heads, head_dim)
    return (torch.randn(shape, device="cuda", dtype=torch.bfloat16),
            torch.randn(shape, device="cuda", dtype=torch.bfloat16), block, num_blocks)


def attention_sweep(caches, heads: int = 14, head_dim: int = 64, width: int = 32) -> None:
    """Decode attention over separate K and V caches with A-like tables (shared prompt blocks, scattered own
    blocks): the kernel's keys per iteration, warps and pipeline stages, each timed as a CUDA graph.
    caches: (k_cache, v_cache, block size, blocks in the pool); width: block-table columns."""
    from cohort.engine import triton_ops

    kc, vc, block, nb = caches
    tile, stages = triton_ops.decode_tile(head_dim)
    default = (tile, triton_ops.DECODE_WARPS, stages)
    variants = [(t, w, st) for t in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    if head_dim > 64:  # 128 keys of wide heads in 3-4 stages do not fit in shared memory
        variants = [v for v in variants if v[0] < 128 or v[2] == 2]
    print("| decode attention, 1 layer | " + " | ".join(f"tile {t} w{w} s{st}" for t, w, st in variants) + " |")
    print("| --- |" + " ---: |" * len(variants))
    for rows, ctx in ((256, 260), (256, 384), (256, 1024), (128, 1024), (64, 1536), (16, 2000)):
        q = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        tables = a_like_tables(rows, ctx, block, width, nb)
        lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
        cells = []
        for t, w, st in variants:
            try:
                us = graph_ms(lambda t=t, w=w, st=st, q=q, tables=tables, lens=lens:
                              triton_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.125, tile=t, num_warps=w,
                                                                num_stages=st)) * 1000
            except Exception as exc:  # a variant past the shared-memory limit: say so, time the rest
                cells.append(type(exc).__name__[:12])
                continue
            cells.append(f"{us:.1f}" + ("*" if (t, w, st) == default else ""))
        print(f"| {rows} seqs x ctx {ctx} | " + " | ".join(cells) + " |", flush=True)
    print("(* the default)")


def traced_generate(engine, prompts, trace_dir: str | None) -> None:
    """Workload A through engine.generate (the real loop: chained launches, no extra synchronisation) under
    torch.profiler: where the device sits idle."""
    from torch.profiler import ProfilerActivity, profile

    from cohort.types import SamplingParams

    params = SamplingParams(n=8, max_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    print(f"engine.generate, workload A, under the profiler: {wall * 1000:.0f} ms wall")
    print(trace_gaps.summary(prof, "engine.generate timeline"))
    if trace_dir:
        trace_gaps.save(prof, os.path.join(trace_dir, "engine-generate-trace.json.gz"))


def traced_mixed(engine, vocab: int, trace_dir: str | None) -> None:
    """Workload B (bench/rollout.py's mixed workload) through engine.generate under torch.profiler: where
    the device sits idle (chain breaks, prefills, the small-batch tail)."""
    from torch.profiler import ProfilerActivity, profile

    prefills, decodes = engine.stats.prefill_steps, engine.stats.decode_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tok_s, wall, tokens, _ = run_engine_mixed(engine, vocab)
        torch.cuda.synchronize()
    print(f"engine.generate, workload B, under the profiler: {tokens} tokens in {wall * 1000:.0f} ms "
          f"({tok_s:,.0f} tok/s); {engine.stats.prefill_steps - prefills} prefill steps, "
          f"{engine.stats.decode_steps - decodes} decode steps")
    print(trace_gaps.summary(prof, "engine.generate timeline, workload B"))
    if trace_dir:
        trace_gaps.save(prof, os.path.join(trace_dir, "engine-generate-b-trace.json.gz"))


def step_breakdown(engine, prompts) -> dict[str, float]:
    """Run workload A through engine.step with timers around each phase (synchronising between them)."""
    from cohort.types import SamplingParams

    params = SamplingParams(n=8, max_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
    for i, p in enumerate(prompts):
        engine._add(i, p, params)
    phases = {"schedule": 0.0, "forward+sample": 0.0, "eager sample": 0.0, "append+finish": 0.0}
    sched, runner = engine.scheduler, engine.runner
    steps = 0
    while sched.has_work():
        if sched.waiting:  # prefill steps are not what this measures
            engine.step()
            continue
        t0 = time.perf_counter()
        step = sched.schedule()
        t1 = time.perf_counter()
        if not step.seqs:  # nothing to decode this step (as CohortEngine.step)
            continue
        logits, sampled = runner.decode(step.seqs)  # in-graph sampler: decode includes sampling
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        tokens, logprobs = sampled if sampled is not None else engine.sampler(logits, step.seqs)
        t3 = time.perf_counter()
        for seq, tok, lp in zip(step.seqs, tokens, logprobs):
            seq.append(tok, lp, None)
        sched.finish(step.seqs)
        t4 = time.perf_counter()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[k] += v
        steps += 1
    return {k: 1000 * v / steps for k, v in phases.items()}


def loop_breakdown(engine, prompts) -> str:
    """Workload A through the engine's own loop (multi-step decode included), each engine.step() timed with a
    synchronisation after it: prefill vs decode iterations, and the decode iterations' host share."""
    from cohort.types import SamplingParams

    params = SamplingParams(n=8, max_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
    for i, p in enumerate(prompts):
        engine._add(i, p, params)
    prefill_ms = decode_ms = 0.0
    iterations = 0
    stats = engine.stats
    steps0 = stats.decode_steps
    torch.cuda.synchronize()
    wall = time.perf_counter()
    while engine.scheduler.has_work():
        before = stats.prefill_steps
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        dt = 1000 * (time.perf_counter() - t0)
        if stats.prefill_steps != before:
            prefill_ms += dt
        else:
            decode_ms += dt
            iterations += 1
    wall = 1000 * (time.perf_counter() - wall)
    steps = stats.decode_steps - steps0
    return (f"engine loop, workload A: {wall:.0f} ms in all; prefill {prefill_ms:.1f} ms; decode {decode_ms:.0f} ms "
            f"in {iterations} iterations of {engine.runner.decode_steps} steps ({decode_ms / max(steps, 1):.3f} ms "
            f"per step)")


def lm_head_table(hidden: int = 896, vocab: int = 151936) -> None:
    """The decode LM head at 1-256 rows in the two layouts cuBLAS can give: logits [rows, vocab] (x @ W^T, what
    the engine and its sampler use) and their transpose [vocab, rows] (W @ x^T), each timed as a CUDA graph."""
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    print(f"| LM head {hidden} x {vocab}, rows | x @ W^T us | W @ x^T us |\n| ---: | ---: | ---: |")
    for rows in (256, 128, 64, 16, 1):
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        rows_out = torch.empty(rows, vocab, device="cuda", dtype=torch.bfloat16)
        cols_out = torch.empty(vocab, rows, device="cuda", dtype=torch.bfloat16)
        a = graph_ms(lambda x=x, o=rows_out: torch.matmul(x, w.t(), out=o)) * 1000
        b = graph_ms(lambda x=x, o=cols_out: torch.matmul(w, x.t(), out=o)) * 1000
        print(f"| {rows} | {a:.1f} | {b:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace-dir", default=None, help="save the engine.generate Chrome trace (gzipped) here")
    p.add_argument("--attention-only", action="store_true", help="only the decode-attention sweep")
    p.add_argument("--sampler-passes", action="store_true", help="only the Gumbel vs inverse-CDF sampler table")
    p.add_argument("--heads", type=int, default=None,
                   help="--attention-only on standalone caches: query heads (1.5B: 12), with --head-dim")
    p.add_argument("--head-dim", type=int, default=None, help="--attention-only: head size (1.5B: 128)")
    p.add_argument("--lm-head", action="store_true", help="only the LM head's two layouts")
    args = p.parse_args()
    if args.lm_head:
        lm_head_table()
        return
    if args.sampler_passes:
        sampler_pass_table()
        return
    if args.heads or args.head_dim:  # another architecture's decode attention (2 KV heads), no model built
        heads, head_dim = args.heads or 12, args.head_dim or 128
        attention_sweep(standalone_caches(2, head_dim), heads, head_dim)
        return
    from cohort.engine import CohortEngine
    from cohort.engine.triton_ops import fused_sample, paged_decode_attention

    model = build_model()
    engine = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256)
    runner = engine.runner
    caches = (runner.kv_cache[0, 0], runner.kv_cache[1, 0], runner.config.block_size, runner.num_blocks)
    attention_sweep(caches, model.config.num_attention_heads,
                    model.config.hidden_size // model.config.num_attention_heads, runner.config.max_blocks_per_seq)
    if args.attention_only:
        return
    graph = runner.graphs[256][0]  # batch size -> (graph, logits, tokens, logprobs): only the graph is timed
    print(f"graph replay bs=256 (ctx 1, scratch rows): {gpu_ms(graph.replay):.3f} ms")
    if 256 in runner.multi_graphs:
        multi = runner.multi_graphs[256]
        print(f"multi-step graph replay bs=256, {runner.decode_steps} steps: {gpu_ms(multi.replay):.3f} ms "
              f"({gpu_ms(multi.replay) / runner.decode_steps:.3f} ms per step)")
    seeds = torch.randint(0, 2**62, (256,), device="cuda")
    positions = torch.randint(0, 2048, (256,), device="cuda")
    inv_t = torch.ones(256, device="cuda")
    noise = torch.ones(256, device="cuda")
    fake = torch.randn(256, model.config.vocab_size, device="cuda").to(torch.bfloat16)
    print(f"fused sampler 256 x {fake.shape[1]}: {gpu_ms(lambda: fused_sample(fake, fake, inv_t, noise, seeds, positions)):.3f} ms")
    sampler_table(model.config.vocab_size)
    matmul_table(model.config)
    q = torch.randn(256, 14, 64, device="cuda", dtype=torch.bfloat16)
    kc = runner.kv_cache[0, 0]
    width = runner.config.max_blocks_per_seq
    for rows, ctx in ((256, 256), (256, 1024), (256, 2048), (64, 1536), (16, 2000)):
        tables = torch.randint(0, runner.num_blocks, (rows, width), device="cuda", dtype=torch.int32)
        lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
        times = [graph_ms(lambda tables=tables, lens=lens, s=s, qr=q[:rows]: paged_decode_attention(
            qr, kc, kc, tables, lens, 0.125, splits=s)) * 1000 for s in (1, None)]
        print(f"paged decode attention, 1 layer, {rows} seqs x ctx {ctx}: one program per (seq, KV head) "
              f"{times[0]:.1f} us, default splits {times[1]:.1f} us")
    prompts = workload_a(model.config.vocab_size)
    parts = step_breakdown(engine, prompts)
    print("per decode step (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
    print(loop_breakdown(engine, prompts))
    traced_generate(engine, prompts, args.trace_dir)
    traced_mixed(engine, model.config.vocab_size, args.trace_dir)
    del engine, runner, graph
    torch.cuda.empty_cache()
    kernel_table(model, prompts)


def kernel_table(model, prompts, steps: int = 5) -> None:
    """The kernels of one decode step at batch 256 (context ~140), from torch.profiler over eager steps of an
    engine without graphs: the same kernels a captured graph replays, with their GPU times and counts."""
    from torch.profiler import ProfilerActivity, profile

    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams

    eager = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256, enforce_eager=True,
                         decode_steps=1)
    params = SamplingParams(n=8, max_tokens=64, temperature=1.0, ignore_eos=True, seed=0)
    for i, p in enumerate(prompts):
        eager._add(i, p, params)
    while eager.scheduler.waiting:
        eager.step()
    for _ in range(3):
        eager.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eager.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events) / steps / 1000
    count = sum(e.count for e in events) / steps
    print(f"eager decode step at batch 256: {count:.0f} kernels, {total:.3f} ms of kernel time per step")
    print("| kernel | calls/step | us/step |\n| --- | ---: | ---: |")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"| {e.key[:90]} | {e.count / steps:.0f} | {e.self_device_time_total / steps:.0f} |")


if __name__ == "__main__":
    main()

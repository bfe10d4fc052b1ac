"""Decode at long context: the engine's generation time, its kernels, and the bytes-moved ceiling (one GPU).

    python bench/long_decode.py                       # 0.5B, 64 sequences of 256 + 4,096 tokens
    python bench/long_decode.py --size 1.5b --completion-len 8192 --out results.json

Issue 33's decode row: the Qwen2.5-0.5B architecture (random bf16 weights, bench/rollout.py's model; --size 1.5b
the Qwen2.5-1.5B shape), BATCH prompts of PROMPT_LEN random tokens, one completion each of exactly
COMPLETION_LEN tokens (EOS ignored), temperature 1. The engine is sized as training sizes it
(max_model_len = prompt + completion). Reported:
- the generation's wall time (median of --repeats after one untimed run of the same shapes) and tok/s;
- ms per decode step (wall time / completion length), beside the ceiling: every step reads all weights once,
  every live sequence's KV at its context, writes the new KV and the logits, at the device's measured copy
  bandwidth (bench/rollout.py's decode_ceiling);
- where the device time goes: one run under torch.profiler, kernels grouped (decode attention, matmuls,
  sampler, prefill attention, the rest) with their share of the busy time, and the device's idle time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rollout import build_model, copy_bandwidth, decode_ceiling  # bench/ is the script's folder

GROUPS = (  # (group, substrings of kernel names), first match wins
    ("decode attention", ("_paged_decode",)),
    ("prefill attention", ("flash", "fmha", "varlen", "attention")),
    ("sampler", ("_sample", "sample", "gumbel", "cdf")),
    ("matmul", ("gemm", "cutlass", "sm90", "nvjet", "matmul", "Gemm")),
    ("norm / rope / elementwise", ("rms", "rope", "elementwise", "vectorized", "triton_", "silu")),
)


def bigger_model(size: str) -> torch.nn.Module:
    """The bench model of a size: 0.5b is bench/rollout.py's; 1.5b the Qwen2.5-1.5B shape, random bf16."""
    if size == "0.5b":
        return build_model()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def kernel_table(prof) -> dict[str, float]:
    """Device milliseconds per kernel group, plus 'busy' and 'span' (first kernel start to last end)."""
    groups: dict[str, float] = {}
    starts, ends = [], []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        groups[group_of(evt.name)] = groups.get(group_of(evt.name), 0.0) + dur / 1000
        starts.append(evt.time_range.start)
        ends.append(evt.time_range.end)
    groups["busy"] = sum(v for k, v in groups.items())
    groups["span"] = (max(ends) - min(starts)) / 1000 if starts else 0.0
    return groups


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.5b", choices=("0.5b", "1.5b"))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled run")
    p.add_argument("--out", default=None, help="write the row as JSON here (a manifest beside it)")
    args = p.parse_args()

    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams

    model = bigger_model(args.size)
    engine = CohortEngine(model, eos_token_ids=None, max_model_len=args.prompt_len + args.completion_len,
                          max_num_seqs=max(args.batch, 64))
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, model.config.vocab_size, (args.batch, args.prompt_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=args.completion_len, temperature=1.0, ignore_eos=True, seed=0)
    engine.generate(prompts, params)  # the same shapes once: graphs captured, caches warm
    times = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = sum(len(g[0].token_ids) for g in out)
    bandwidth = copy_bandwidth()
    ceiling_tok_s = decode_ceiling(model, args.batch, args.prompt_len, args.completion_len, bandwidth)
    row = {"size": args.size, "batch": args.batch, "prompt_len": args.prompt_len,
           "completion_len": args.completion_len, "device": torch.cuda.get_device_name(),
           "engine": engine.engine_name() if hasattr(engine, "engine_name") else "cohort",
           "generate_s": seconds, "runs_s": times, "tokens": tokens, "tok_s": tokens / seconds,
           "ms_per_decode_step": 1000 * seconds / args.completion_len,
           "copy_bandwidth_gb_s": bandwidth / 1e9, "ceiling_tok_s": ceiling_tok_s,
           "ceiling_generate_s": tokens / ceiling_tok_s,
           "ceiling_ms_per_step": 1000 * tokens / ceiling_tok_s / args.completion_len}
    if not args.no_profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, params)
            torch.cuda.synchronize()
        row["kernels_ms"] = kernel_table(prof)
    print(json.dumps(row, indent=1), flush=True)
    print(f"\n{args.size}, {args.batch} x ({args.prompt_len} + {args.completion_len}): generate {seconds:.2f} s, "
          f"{row['tok_s']:.0f} tok/s, {row['ms_per_decode_step']:.3f} ms/step; ceiling "
          f"{row['ceiling_generate_s']:.2f} s ({row['ceiling_ms_per_step']:.3f} ms/step at "
          f"{row['copy_bandwidth_gb_s']:.0f} GB/s)")
    if args.out:
        from manifest import record_run

        with open(args.out, "w") as fh:
            json.dump(row, fh, indent=1)
        record_run("bench/long_decode.py: decode at long context against the bytes-moved ceiling", args.out)


if __name__ == "__main__":
    main()

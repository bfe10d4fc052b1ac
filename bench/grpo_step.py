"""One GRPO step end to end: cohort's trainer against TRL's GRPOTrainer on the same GPU, one table, one run.

    python bench/grpo_step.py                           # 0.5B and 1.5B: TRL, cohort fast, cohort low-memory
    python bench/grpo_step.py --sizes 0.5b --warmup 1 --steps 2
    python bench/grpo_step.py --sizes tiny --prompts 4 --generations 4 --prompt-len 16 --completion-len 16
                                                        # CPU smoke test of every code path

Workload (identical on both sides): the Qwen2.5 architecture (0.5B or 1.5B) with random bf16 weights; each
step 32 prompts x 8 completions, prompts of exactly 128 tokens (random token ids), completions of exactly
256 tokens (EOS never ends them: cohort `generation.ignore_eos`, TRL `min_new_tokens`), temperature 1, a
cheap length reward, one optimizer update per step, beta = 0 (no reference model), on-policy.
The tokenizer is a word-level one built here (`w0 w1 ...`, one word per model id, EOS = Qwen's 151643), so a
prompt is exactly its 128 words and every id the model can sample decodes; nothing is downloaded.

The TRL side (and how its phases are timed) is in bench/grpo_step_trl.py.
Every (size, runner) pair runs in its own subprocess, one after another, so GPU memory peaks never mix;
the parent prints the table. Peak memory is torch.cuda.max_memory_allocated / max_memory_reserved over the
training steps (reset after setup). Seconds per step are the mean over the steps after `--warmup`.
Phases: generate (cohort: sampling, decode to text, advantages; TRL: tokenise and HF generate, its decode
and advantages fall in "other"), score (reward functions), logprobs (no-grad
forwards before the update: old/reference logprobs; zero on-policy with beta = 0 on both sides), update
(forward, backward and optimizer step), other (the rest of the step). Update MFU = 6 * N * tokens in the
update / update seconds / peak, with N all parameters (the tied embedding counted once, as the LM head)
and peak 989e12 (H100 SXM dense bf16); recomputation under gradient checkpointing is not counted.

Runners: `trl` (GRPOTrainer, its defaults: HF generate, gradient checkpointing, bf16 AdamW states,
8 completions per micro-batch, so 32 accumulation steps); `cohort` (fast: no checkpointing, fp32 master
weights and AdamW, packed micro-batches of `--token-budget` tokens, KV pool sized to the workload, decoder
layers compiled with cohort.packing.compile_decoder_layers on CUDA, retried eager if that fails);
`cohort-lowmem` (gradient checkpointing, bf16 AdamW states as TRL, 2048-token micro-batches, 256-token
logprob chunks (--lowmem-token-budget, --lowmem-chunk-tokens), KV pool = what is left of TRL's measured peak after the memory estimate).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from unittest import mock

import torch

SIZES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 1024},
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936},
}
FAST_TOKEN_BUDGET = {"tiny": 256, "0.5b": 16384, "1.5b": 8192}
PEAK_FLOPS = 989e12  # H100 SXM, dense bf16
QWEN_EOS = 151643
RUNNERS = ("trl", "cohort", "cohort-lowmem")
ENGINE_MAX_MODEL_LEN = 4096  # CohortEngine default for these configs (min(max_position_embeddings, 4096))


# ---------------------------------------------------------------------------------------------------------
# Workload pieces shared by both sides


def eos_id(vocab_size: int) -> int:
    return QWEN_EOS if vocab_size > QWEN_EOS else vocab_size - 1


def build_tokenizer(vocab_size: int):
    """Word-level tokenizer with one word per model id ("w17"), EOS at Qwen's id; decodes any sampled id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    eos = eos_id(vocab_size)
    vocab = {("<|endoftext|>" if i == eos else f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=1 << 20)


def make_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[str]:
    """`count` prompts of exactly `length` random words (never EOS)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size - 1, (count, length), generator=gen)
    ids[ids >= eos_id(vocab_size)] += 1  # skip the EOS id, stay below vocab_size
    return [" ".join(f"w{int(i)}" for i in row) for row in ids]


def length_reward(completions, **kwargs) -> list[float]:
    """Cheap reward: characters / 1000 (completions have equal token counts but differ in characters)."""
    return [len(c) / 1000.0 for c in completions]


def build_model(size: str, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = SIZES[size]
    eos = eos_id(spec["vocab_size"])
    config = Qwen2Config(**spec, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    return model


def kv_bytes_per_token(model) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize  # K and V


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {"peak_alloc_gib": float("nan"), "peak_reserved_gib": float("nan")}
    return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


# ---------------------------------------------------------------------------------------------------------
# cohort side


class TimedRewards:
    """Wraps a RewardRunner and records the seconds of each call (cohort's time/generate includes scoring)."""

    def __init__(self, runner):
        self.runner, self.seconds = runner, []

    def __call__(self, **kwargs):
        start = time.perf_counter()
        try:
            return self.runner(**kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)

    def __getattr__(self, name):
        return getattr(self.runner, name)


def _bf16_adamw(model, *, lr, weight_decay, betas):
    """TRL's optimizer state precision (AdamW moments in the bf16 parameters' dtype, no fp32 master)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].is_cuda
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, fused=fused)


def _cohort_config(args, lowmem: bool, kv_fraction: float):
    from cohort.config import CohortConfig

    cfg = CohortConfig()
    cfg.model.gradient_checkpointing = lowmem
    g = cfg.generation
    g.num_generations, g.max_completion_length, g.temperature = args.generations, args.completion_len, 1.0
    g.ignore_eos, g.engine, g.kv_cache_fraction = True, "cohort", kv_fraction
    cfg.data.max_prompt_length = args.prompt_len
    t = cfg.train
    t.prompts_per_step, t.mini_batches, t.num_iterations = args.prompts, 1, 1
    t.max_steps, t.seed = args.warmup + args.steps, 0
    t.token_budget = args.lowmem_token_budget if lowmem else (args.token_budget or FAST_TOKEN_BUDGET[args.size])
    cfg.loss.beta = 0.0
    cfg.run.output_dir = tempfile.mkdtemp(prefix="grpo_step_")
    cfg.run.overwrite, cfg.run.report_to = True, ["jsonl"]
    return cfg


def _kv_plan(args, model, device, lowmem: bool) -> tuple[float, dict]:
    """kv_cache_fraction for the engine: the workload's KV (x1.25), or for lowmem what the cap leaves."""
    from cohort.memory import estimate_memory

    per_token = kv_bytes_per_token(model)
    need = args.prompts * args.generations * (args.prompt_len + args.completion_len) * per_token
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else 4 << 30
    info = {"kv_need_gib": need / 2**30}
    kv = 1.25 * need
    if lowmem and args.mem_cap:
        est = estimate_memory(model.config, dtype="bf16", master_weights_fp32=False,
                              token_budget=args.lowmem_token_budget, gradient_checkpointing=True,
                              chunk_tokens=args.lowmem_chunk_tokens)
        left = 0.95 * args.mem_cap - est.total
        kv = max(0.25 * need, min(1.05 * need, left))
        info.update(estimate_wo_kv_gib=est.total / 2**30, cap_gib=args.mem_cap / 2**30)
    kv = max(kv, 1.1 * ENGINE_MAX_MODEL_LEN * per_token)  # the engine insists on one max-length sequence
    info["kv_planned_gib"] = kv / 2**30
    return min(1.0, kv / free), info


def run_cohort(args, lowmem: bool) -> dict:
    import cohort.engine
    import cohort.packing
    import cohort.setup
    import cohort.trainer

    device = torch.device(args.device)
    model = build_model(args.size, device)
    tok = build_tokenizer(model.config.vocab_size)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(cohort.trainer, "_save", lambda *a, **k: None))  # no checkpoint
        if lowmem:  # settings the config does not expose yet
            stack.enter_context(mock.patch.object(cohort.setup, "build_optimizer", _bf16_adamw))
            stack.enter_context(mock.patch.dict(cohort.packing.packed_forward_logprobs.__kwdefaults__,
                                                {"chunk_tokens": args.lowmem_chunk_tokens}))
            # no fused QKV / gate-up weight copies in the engine (they cost ~0.5 GB on 0.5B, ~1.7 GB on 1.5B)
            stack.enter_context(mock.patch.object(cohort.engine, "CohortEngine",
                                                  functools.partial(cohort.engine.CohortEngine,
                                                                    fuse_projections=False)))
        return _train_cohort(args, lowmem, model, tok, device)


def _train_cohort(args, lowmem: bool, model, tok, device) -> dict:
    import cohort.trainer
    from cohort.data.dataset import PromptDataset
    from cohort.rewards import RewardRunner

    kv_fraction, info = _kv_plan(args, model, device, lowmem)
    cfg = _cohort_config(args, lowmem, kv_fraction)
    rows = [{"prompt": p} for p in make_prompts(args.prompts * cfg.train.max_steps, args.prompt_len,
                                                 model.config.vocab_size)]
    data = PromptDataset(rows, "bench").encode(tok, args.prompt_len)
    rewards = TimedRewards(RewardRunner([length_reward]))
    comp = cohort.trainer.build_components(cfg, policy=model, tokenizer=tok, reward_runner=rewards,
                                           train_data=data, echo=lambda *a: None)
    info["engine"] = comp.engine.engine_name() if hasattr(comp.engine, "engine_name") else type(comp.engine).__name__
    info.update(optimizer=type(comp.optimizer).__name__, token_budget=cfg.train.token_budget,
                gradient_checkpointing=lowmem, compiled_layers=0)
    if args.compile_layers:  # cohort.packing.compile_decoder_layers: fused elementwise work in training
        from cohort.packing import compile_decoder_layers

        info["compiled_layers"] = compile_decoder_layers(model)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = cohort.trainer.train(cfg, comp, echo=lambda *a: None)
    steps = []
    for m, score in zip(result.history, rewards.seconds):
        gen = m["time/generate"] - score
        phases = {"generate": gen, "score": score, "logprobs": m.get("time/logprobs", 0.0),
                  "update": m["time/update"]}
        steps.append({**phases, "step": m["step_time"], "other": m["step_time"] - sum(phases.values()),
                      "completion_len": m["completions/mean_length"]})
    return {"steps": steps, "num_params": sum(p.numel() for p in model.parameters()), **info,
            **peak_memory(device)}


# ---------------------------------------------------------------------------------------------------------
# Parent: run the children, summarise, print


def summarise(args, result: dict) -> dict:
    """Steady-state means (steps after warmup) and the derived rates."""
    steady = result["steps"][args.warmup:] or result["steps"]
    mean = {k: sum(s[k] for s in steady) / len(steady)
            for k in ("step", "generate", "score", "logprobs", "update", "other")}
    n = args.prompts * args.generations
    update_tokens = n * (args.prompt_len + args.completion_len)
    mean["gen_tok_s"] = n * args.completion_len / mean["step"]
    mean["mfu"] = 6 * result["num_params"] * update_tokens / mean["update"] / PEAK_FLOPS
    mean["measured_steps"] = len(steady)
    return mean


def run_child(args, runner: str, size: str, mem_cap: int | None, timeout: float, compile_layers: bool) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", runner, "--size", size, "--json", out,
           "--device", args.device, "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--prompts", str(args.prompts), "--generations", str(args.generations),
           "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len)]
    if mem_cap:
        cmd += ["--mem-cap", str(mem_cap)]
    cmd += ["--lowmem-token-budget", str(args.lowmem_token_budget),
            "--lowmem-chunk-tokens", str(args.lowmem_chunk_tokens)]
    if args.token_budget:
        cmd += ["--token-budget", str(args.token_budget)]
    cmd += ["--compile-layers" if compile_layers else "--no-compile-layers"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        log, ok = proc.stdout + proc.stderr, proc.returncode == 0 and os.path.exists(out)
    except subprocess.TimeoutExpired as exc:
        log, ok = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT after {timeout:.0f} s", False
    wall = time.perf_counter() - start
    if args.log:
        with open(args.log, "a") as fh:
            fh.write(f"\n===== {size} {runner} ({wall:.0f} s) =====\n{log}")
    if not ok:
        tail = "\n".join(log.strip().splitlines()[-15:])
        print(f"[{size} {runner}] FAILED after {wall:.0f} s:\n{tail}", flush=True)
        return {"error": tail.splitlines()[-1] if tail else "failed", "wall_s": wall}
    with open(out) as fh:
        result = json.load(fh)
    result["wall_s"] = wall
    result["summary"] = summarise(args, result)
    print(f"[{size} {runner}] {wall:.0f} s wall: " + json.dumps(result["summary"]), flush=True)
    return result


def fmt_row(size: str, runner: str, res: dict, trl: dict | None) -> str:
    if "summary" not in res:
        why = res.get("error", "?")
        label = "not run" if why.startswith("skipped") else "failed"
        return f"| {size} | {runner} | {label}: {why[:80]} |" + " |" * 10
    s = res["summary"]
    ph = " | ".join(f"{s[k]:.2f}" for k in ("generate", "score", "logprobs", "update", "other"))
    speedup = trl["summary"]["step"] / s["step"] if trl and "summary" in trl else float("nan")
    within = ""
    if runner == "cohort-lowmem" and trl and trl.get("peak_alloc_gib") == trl.get("peak_alloc_gib"):  # not NaN
        within = " (within TRL peak)" if res["peak_alloc_gib"] <= trl["peak_alloc_gib"] else " (over TRL peak)"
    return (f"| {size} | {runner} | {s['step']:.2f} | {ph} | {s['gen_tok_s'] / 1e3:.1f}k | "
            f"{res['peak_alloc_gib']:.2f}{within} | {res['peak_reserved_gib']:.2f} | {100 * s['mfu']:.1f}% | "
            f"{speedup:.2f}x |")


def table(results: dict) -> str:
    head = ("| model | trainer | s/step | generate | score | logprobs | update | other | generated tok/s | "
            "peak alloc GiB | peak reserved GiB | update MFU | vs TRL |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = [fmt_row(size, runner, res, by_runner.get("trl"))
            for size, by_runner in results.items() for runner, res in by_runner.items()]
    return "\n".join([head, *rows])


def parent(args) -> None:
    deadline = time.monotonic() + args.budget_s
    results: dict[str, dict[str, dict]] = {}
    for size in args.sizes.split(","):
        results[size] = {}
        for runner in args.runners.split(","):
            left = deadline - time.monotonic()
            if left < 30:
                print(f"[{size} {runner}] skipped: {left:.0f} s of --budget-s left", flush=True)
                results[size][runner] = {"error": "skipped (time budget)"}
                continue
            trl = results[size].get("trl", {})
            peak = trl.get("peak_alloc_gib", float("nan"))
            peak = peak if peak == peak else args.mem_cap_gib  # NaN on the CPU or without a TRL row
            cap = int(peak * 2**30) if runner == "cohort-lowmem" and peak else None
            compiled = args.compile_layers and runner != "trl"
            res = run_child(args, runner, size, cap, min(left, args.child_timeout_s), compiled)
            left = deadline - time.monotonic()
            if "summary" not in res and compiled and left > 60:  # one retry with eager layers
                res = run_child(args, runner, size, cap, min(left, args.child_timeout_s), False)
                res["retried_without_compile"] = True
            results[size][runner] = res
    print("\n" + table(results), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1, default=str)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.5b,1.5b")
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps after warmup")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--token-budget", type=int, default=None, help="cohort fast row (default per size)")
    p.add_argument("--budget-s", type=float, default=86400.0, help="stop starting children after this long")
    p.add_argument("--lowmem-token-budget", type=int, default=2048)
    p.add_argument("--lowmem-chunk-tokens", type=int, default=256)
    p.add_argument("--mem-cap-gib", type=float, default=None,
                   help="low-memory row's target peak when no TRL row ran in this run (else TRL's peak)")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction,
                   default=torch.cuda.is_available(), help="cohort rows: torch.compile each decoder layer")
    p.add_argument("--child-timeout-s", type=float, default=240.0, help="kill a run after this long")
    p.add_argument("--out", default=None, help="JSON with every step of every run")
    p.add_argument("--log", default=None, help="append every child's output here")
    p.add_argument("--child", choices=RUNNERS, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--mem-cap", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is None:
        return parent(args)
    if args.child == "trl":
        from grpo_step_trl import run_trl  # bench/ is the script's folder, so on sys.path

        result = run_trl(args)
    else:
        result = run_cohort(args, lowmem=args.child == "cohort-lowmem")
    with open(args.json, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()

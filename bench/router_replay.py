"""Train/inference mismatch of a Qwen3-MoE policy with and without router replay (train.router_replay, issue 38).

cohort's engine samples completions in bf16 and records every token's experts (record_routes); the training forward
(transformers' Qwen3MoeForCausalLM through cohort's packed forward, as the update runs it) then computes the logprobs
of the same tokens twice: with its own routing, and replaying the engine's (cohort.forward.router_replay). For each,
over every completion token, against the engine's sampling logprobs:

- mean and max |logprob difference|;
- k3, the estimate of KL(engine || trainer) from the engine's samples: r = lp_train - lp_engine, k3 = e^r - 1 - r
  (mean over tokens; Schulman's low-variance estimator, the one the KL losses use);
- routing agreement (own routing only): the share of (token, sparse layer) pairs whose top-k set the training
  router picks equals the engine's, and the mean share of the k experts the two have in common.

Model: the Qwen3-30B-A3B shape (48 layers, hidden 2048, 128 experts of 768, top-8, 32 query / 4 KV heads of 128,
vocab 151936; ~61 GB of bf16 weights, one 80 GB GPU) with random weights, `--layers` fewer to save memory, or a real
checkpoint (`--model`). `--tiny`: a tiny random Qwen3-MoE on the CPU (tests/unit/test_bench_router_replay.py runs it).
The JSON goes to --out (default on the GPU: a new bench/results/<date>-router-replay/ folder) with its manifest.

    PYTHONPATH=src python3 bench/router_replay.py [--layers 48] [--prompts 32 --samples 4 --prompt-len 128
        --max-tokens 512] [--model PATH] [--out FILE]
    PYTHONPATH=src python3 bench/router_replay.py --tiny --out /tmp/router_replay.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from manifest import new_run_folder, record_run  # bench/ is the script's folder, so on sys.path
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from cohort.engine import CohortEngine
from cohort.forward.micro_batches import split_grouped_micro_batches, split_micro_batches
from cohort.forward.packing import pack_row, packed_forward_logprobs
from cohort.forward.router_replay import replaying, routers
from cohort.forward.shared_prompts import prompt_groups
from cohort.policy.model import load_policy
from cohort.types import SamplingParams

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=1024)


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """A random-weight Qwen3-MoE of the bench shape (or --tiny's), or --model loaded, in --dtype on `device`."""
    dtype = getattr(torch, args.dtype)
    if args.model:
        model, _ = load_policy(args.model, dtype=args.dtype, device=device)
        return model.eval()
    shape = dict(TINY) if args.tiny else {**QWEN3_30B_A3B, "num_hidden_layers": args.layers}
    config = Qwen3MoeConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def sample(model, args: argparse.Namespace, vocab: int):
    """(prompts, completions grouped per prompt, engine description, seconds) from a recording engine."""
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]
    engine = CohortEngine(model, eos_token_ids=None, max_model_len=args.prompt_len + args.max_tokens,
                          max_num_seqs=args.max_num_seqs, kv_cache_fraction=args.kv_cache_fraction,
                          record_routes=True)
    params = SamplingParams(n=args.samples, max_tokens=args.max_tokens, temperature=1.0, seed=args.seed,
                            ignore_eos=True)
    start = time.perf_counter()
    groups = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    name = engine.engine_name()
    engine.release_kv_cache()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return prompts, groups, name, seconds


def _micro_batches(pairs, token_budget: int, share_prompts: bool) -> list[list[int]]:
    """The update's micro-batches of the (prompt, completion) pairs (cohort.update's split)."""
    prompt_lens = [len(p) for p, _ in pairs]
    completion_lens = [len(c) for _, c in pairs]
    if share_prompts:
        return split_grouped_micro_batches(prompt_groups([p for p, _ in pairs]), prompt_lens, completion_lens,
                                           token_budget)
    return split_micro_batches([p + c for p, c in zip(prompt_lens, completion_lens)], token_budget)


def _agreement(own: list[torch.Tensor], replay) -> tuple[float, float, int]:
    """(sum of equal top-k sets, sum of shared-expert shares, pairs counted) of the training router's own choices
    `own` (one [T, k] per sparse layer) against the row's recorded ones, over the rows with a record."""
    valid = replay.valid
    equal, shared, count = 0.0, 0.0, 0
    for j, mine in enumerate(own):
        mine = mine[valid].sort(dim=-1).values
        theirs = replay.experts[:, j][valid].long().sort(dim=-1).values
        equal += float((mine == theirs).all(dim=-1).sum())
        shared += float((mine[:, :, None] == theirs[:, None, :]).any(dim=-1).float().mean(dim=-1).sum())
        count += int(mine.shape[0])
    return equal, shared, count


@torch.inference_mode()
def trainer_logprobs(model, pairs, routes, args: argparse.Namespace):
    """The training forward's logprobs of every completion, with its own routing and replaying the records, and the
    routing agreement of its own routing with the records."""
    own_lp: list[torch.Tensor | None] = [None] * len(pairs)
    replay_lp: list[torch.Tensor | None] = [None] * len(pairs)
    sums = np.zeros(3)
    for idx in _micro_batches(pairs, args.token_budget, args.share_prompts):
        seqs = [pairs[i] for i in idx]
        row = pack_row(model, seqs, share_prompts=args.share_prompts, routes=[routes[i] for i in idx])
        assert row is not None and row.replay is not None
        picked: list[torch.Tensor] = []
        hooks = [g.register_forward_hook(lambda module, inputs, out, picked=picked: picked.append(out[2]))
                 for g in routers(model)]
        try:
            own = packed_forward_logprobs(model, seqs, compute_entropy=False, share_prompts=args.share_prompts,
                                          chunk_tokens=args.chunk_tokens, row=row)
        finally:
            for hook in hooks:
                hook.remove()
        sums += _agreement(picked, row.replay)
        with replaying(model, row.replay):
            replayed = packed_forward_logprobs(model, seqs, compute_entropy=False,
                                               share_prompts=args.share_prompts, chunk_tokens=args.chunk_tokens,
                                               row=row)
        for i, (a, _), (b, _) in zip(idx, own.split(), replayed.split(), strict=True):
            own_lp[i], replay_lp[i] = a.float().cpu(), b.float().cpu()
    agreement = {"topk_set_equal": sums[0] / max(sums[2], 1), "expert_overlap": sums[1] / max(sums[2], 1),
                 "token_layer_pairs": int(sums[2])}
    return own_lp, replay_lp, agreement


def mismatch(engine_lp: torch.Tensor, train_lp: torch.Tensor) -> dict[str, float]:
    """|difference| statistics and the k3 estimate of KL(engine || trainer) over the tokens."""
    r = train_lp.double() - engine_lp.double()
    k3 = torch.expm1(r) - r
    return {"mean_abs_diff": float(r.abs().mean()), "max_abs_diff": float(r.abs().max()),
            "k3_mean": float(k3.mean()), "tokens": int(r.numel())}


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    model = build_model(args, device)
    config = model.config
    print(f"model: {type(model).__name__}, {config.num_hidden_layers} layers, {config.num_experts} experts top-"
          f"{config.num_experts_per_tok}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, "
          f"{args.dtype} on {device}", flush=True)
    prompts, groups, engine_name, seconds = sample(model, args, config.vocab_size)
    completions = [c for group in groups for c in group]
    pairs = [(p, c.token_ids) for p, group in zip(prompts, groups) for c in group]
    print(f"sampled {len(completions)} completions in {seconds:.1f}s ({engine_name})", flush=True)
    own_lp, replay_lp, agreement = trainer_logprobs(model, pairs, [c.routed_experts for c in completions], args)
    engine_lp = torch.tensor([lp for c in completions for lp in c.logprobs], dtype=torch.float64)
    results = {
        "what": "train/inference logprob mismatch of a Qwen3-MoE with and without router replay",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "dtype": args.dtype,
        "model": args.model or ("tiny random Qwen3-MoE" if args.tiny else
                                f"random Qwen3-30B-A3B shape, {args.layers} layers"),
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "engine": engine_name, "generate_s": seconds, "completions": len(completions),
        "no_replay": mismatch(engine_lp, torch.cat([t for t in own_lp if t is not None])),
        "replay": mismatch(engine_lp, torch.cat([t for t in replay_lp if t is not None])),
        "routing_agreement_without_replay": agreement,
    }
    ratio = results["no_replay"]["k3_mean"] / max(results["replay"]["k3_mean"], 1e-30)
    results["k3_ratio_no_replay_over_replay"] = ratio
    return results


def print_table(results: dict) -> None:
    print(f"{'':12} {'mean |dlp|':>12} {'max |dlp|':>12} {'k3 KL':>12}")
    for mode in ("no_replay", "replay"):
        r = results[mode]
        print(f"{mode:12} {r['mean_abs_diff']:12.5f} {r['max_abs_diff']:12.5f} {r['k3_mean']:12.3e}")
    a = results["routing_agreement_without_replay"]
    print(f"own routing vs the engine's: top-k set equal on {a['topk_set_equal']:.4f} of {a['token_layer_pairs']} "
          f"(token, layer) pairs, {a['expert_overlap']:.4f} of the experts shared; k3 ratio "
          f"{results['k3_ratio_no_replay_over_replay']:.2f}x")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3-MoE on the CPU (the CPU test)")
    p.add_argument("--model", default=None, help="a real Qwen3-MoE checkpoint instead of random weights")
    p.add_argument("--layers", type=int, default=48, help="decoder layers of the random Qwen3-30B-A3B shape")
    p.add_argument("--dtype", default="bfloat16", help="the weights' dtype (the engine samples in it)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-fraction", type=float, default=0.5)
    p.add_argument("--token-budget", type=int, default=8192, help="tokens per packed training forward")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="the logprob kernel's chunk")
    p.add_argument("--no-share-prompts", dest="share_prompts", action="store_false",
                   help="one copy of the prompt per completion in the packed rows (train.share_prompts=false)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the JSON (default: a new bench/results folder; none with --tiny)")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.samples = min(args.prompts, 4), min(args.samples, 2)
        args.prompt_len, args.max_tokens = min(args.prompt_len, 12), min(args.max_tokens, 16)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    results = run(args)
    print_table(results)
    out = args.out or (None if args.tiny else str(new_run_folder("router-replay") / "router_replay.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1) + "\n")
        print(f"results: {out}", flush=True)
        record_run("bench/router_replay.py: train/inference logprob mismatch of a Qwen3-MoE with and without router "
                   "replay (train.router_replay)", out)
    return results


if __name__ == "__main__":
    main()

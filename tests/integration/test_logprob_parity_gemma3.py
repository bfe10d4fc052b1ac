"""generation.logprob_parity=exact on a Gemma 3 text model, on the CPU (Triton's interpreter).

A tiny Gemma3ForCausalLM (local layers with a sliding window shorter than the sequences and their own RoPE base, a
global layer, per-head q/k norms, random norm weights so that Gemma's (1 + weight) scaling shows): the batch-invariant
forward gives transformers' own forward (float32, to rounding), and the engine's sampling log-probabilities of a
mixed batch equal the training forward's recompute from packed rows of another composition, bit for bit; the
fast mode's difference is printed. Runs in a child process (the interpreter must be on when Triton first sees the
kernels); skips without Triton.
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers.engine_checks import recompute_in_rows
from tests.helpers.triton_interpreter import patch_interpreter_index, run_interpreted

WINDOW = 6  # shorter than the prompts and completions: the local layers' window matters
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def tiny_gemma3(dtype: torch.dtype = torch.float32):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              query_pre_attn_scalar=16, max_position_embeddings=256, layer_types=LAYER_TYPES,
                              pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # HF initialises Gemma's norm weights to 0 (a scale of 1): random ones test the offset
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.eval().to(dtype)


def _prompts(n: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, 256, (int(length),), generator=gen).tolist() for length in (9, 3, 14, 7)[:n]]


def _check_forward() -> None:
    """The invariant decoder's hidden states and logprobs against transformers' Gemma 3 forward."""
    from cohort.forward.invariant import attention
    from cohort.forward.invariant.parity import set_logprob_parity
    from cohort.forward.packing import packed_forward_logprobs

    attention.ATTN_TILE, attention.SPLIT_KEYS = 16, 16
    model = tiny_gemma3()
    seqs = [(p, list(range(20, 32))) for p in _prompts(2)]
    with torch.no_grad():
        set_logprob_parity(model, "exact")
        exact = packed_forward_logprobs(model, seqs, temperature=1.0, compute_entropy=False, share_prompts=False)
        for (prompt, completion), (lp, _) in zip(seqs, exact.split(), strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            ref = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(lp.float(), ref, atol=2e-4, rtol=0)
    print("forward ok")


def _sample(mode: str, dtype: torch.dtype):
    from cohort.engine import CohortEngine
    from cohort.forward.invariant.parity import set_logprob_parity
    from cohort.types import SamplingParams

    model = tiny_gemma3(dtype)
    set_logprob_parity(model, mode)
    prompts = _prompts()
    engine = CohortEngine(model, eos_token_ids=None, block_size=16, max_model_len=128)
    groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, temperature=0.7, seed=5, ignore_eos=True))
    return model, [(p, c.token_ids) for p, g in zip(prompts, groups) for c in g], \
        torch.cat([torch.tensor(c.logprobs) for g in groups for c in g])


def _check_engine() -> None:
    from cohort.forward.invariant import attention

    attention.ATTN_TILE, attention.SPLIT_KEYS = 16, 16
    model, seqs, engine_lp = _sample("exact", torch.float32)
    assert model.model.layers[0].self_attn.sliding_window == WINDOW
    rows = [[6, 1, 4], [0, 7, 2, 5, 3]]  # neither the engine's order nor its batches
    trainer_lp = recompute_in_rows(model, seqs, rows, 0.7)
    assert trainer_lp.numel() == engine_lp.numel() == 80
    diff = (trainer_lp - engine_lp).abs().max().item()
    assert diff == 0, f"exact parity (Gemma 3): max |engine - trainer| = {diff}"
    model, seqs, engine_lp = _sample("fast", torch.bfloat16)
    fast = (recompute_in_rows(model, seqs, [list(range(len(seqs)))], 0.7) - engine_lp).abs()
    print(f"Gemma 3 fast mode: max |engine - trainer| = {fast.max().item():.3g}, mean {fast.mean().item():.3g}")
    print("engine ok")


@pytest.mark.parametrize("part", ["forward", "engine"])
def test_gemma3_exact_parity(monkeypatch, part):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    monkeypatch.setenv("COHORT_PARITY_PART", part)
    run_interpreted(__file__, f"{part} ok", timeout_s=600)


if __name__ == "__main__":
    patch_interpreter_index()
    {"forward": _check_forward, "engine": _check_engine}[os.environ.get("COHORT_PARITY_PART", "engine")]()

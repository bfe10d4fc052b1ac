"""The train/inference match on the CPU: the engine's sampling logprobs equal what the trainer's packed
forward recomputes for the same tokens (float32), at the sampling temperature."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model

from cohort.engine import CohortEngine
from cohort.packing import packed_forward_logprobs
from cohort.types import SamplingParams


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_packed_trainer_logprobs(temperature):
    tok = make_tiny_tokenizer()
    model = tiny_model(tok, seed=1).eval()
    prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3? The answer", "hi")]
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id])
    groups = engine.generate(prompts, SamplingParams(n=4, max_tokens=12, temperature=temperature, seed=5))
    seqs = [(p, c.token_ids) for p, g in zip(prompts, groups) for c in g]
    with torch.no_grad():
        packed = packed_forward_logprobs(model, seqs, temperature=temperature, compute_entropy=False)
    engine_lp = torch.cat([torch.tensor(c.logprobs) for g in groups for c in g])
    assert engine_lp.numel() == packed.logprobs.numel() > 0
    torch.testing.assert_close(packed.logprobs, engine_lp, rtol=0, atol=2e-5)

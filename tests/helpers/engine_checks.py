"""Checks shared by the engine tests: the engine's sampling logprobs against the trainer's recompute."""

from __future__ import annotations

import torch

from cohort.forward.packing import packed_forward_logprobs
from cohort.types import SamplingParams


def assert_sampling_logprobs_match_trainer(engine, policy, tok, atol: float = 2e-5) -> None:
    """Sample 3 completions of two prompts at temperature 1 and compare each token's sampling logprob with the
    trainer's packed forward over the same tokens."""
    prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3? The answer")]
    groups = engine.generate(prompts, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=4))
    seqs = [(p, c.token_ids) for p, g in zip(prompts, groups) for c in g]
    with torch.no_grad():
        packed = packed_forward_logprobs(policy, seqs, temperature=1.0, compute_entropy=False)
    sampled = torch.cat([torch.tensor(c.logprobs) for g in groups for c in g])
    assert sampled.numel() == packed.logprobs.numel() > 0
    torch.testing.assert_close(packed.logprobs, sampled, atol=atol, rtol=0)

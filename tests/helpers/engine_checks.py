"""Checks shared by the engine tests: the engine's sampling logprobs against the trainer's recompute, the
recompute from packed rows of a chosen composition, and adapters moved off their start."""

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


def recompute_in_rows(model, seqs, rows: list[list[int]], temperature: float) -> torch.Tensor:
    """Every sequence's logprobs from packed rows holding the sequences `rows[i]` (indices, in that order),
    concatenated in the order of `seqs`."""
    out: list[torch.Tensor | None] = [None] * len(seqs)
    with torch.no_grad():
        for row in rows:
            packed = packed_forward_logprobs(model, [seqs[i] for i in row], temperature=temperature,
                                             compute_entropy=False)
            for i, (lp, _) in zip(row, packed.split(), strict=True):
                out[i] = lp
    return torch.cat(out)  # type: ignore[arg-type]


@torch.no_grad()
def nudge_adapters(policy, seed: int = 0) -> None:
    """What an optimizer step does to LoRA adapters: move them off their start (B starts at zero, which would hide
    a missed merge or a sampler without the adapters). One generator per device, seeded once."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in policy.named_parameters():
        if "lora_" in name:
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            p.add_(torch.randn(p.shape, generator=generators[p.device], device=p.device, dtype=p.dtype) * 0.05)

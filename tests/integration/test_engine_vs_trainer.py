"""The train/inference match on the CPU: the engine's sampling logprobs equal what the trainer's packed
forward recomputes for the same tokens (float32), at the sampling temperature."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model

from cohort.engine import CohortEngine
from cohort.forward.packing import packed_forward_logprobs
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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_multi_turn_engine_logprobs_equal_packed_trainer_logprobs(temperature):
    """A 3-turn conversation (model, tool result, model, tool result, model) is one sequence to the trainer:
    its packed forward over prompt + whole completion gives the engine's logprobs at every model token,
    although the engine computed the later turns on KV blocks kept from the earlier ones."""
    tok = make_tiny_tokenizer()
    model = tiny_model(tok, seed=1).eval()
    prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3? The answer")]
    context = {1: tok(" -> 5.")["input_ids"], 2: tok(" #### 72 the")["input_ids"]}  # stand-ins for tool results
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=4)
    params = SamplingParams(n=3, max_tokens=40, temperature=temperature, seed=5, stop_token_ids=tuple(range(3, 300)))
    groups = engine.generate_turns(prompts, params, lambda turn: context.get(turn.turn))
    completions = [c for g in groups for c in g]
    assert any(c.turns == 3 for c in completions)
    seqs = [(p, c.token_ids) for p, g in zip(prompts, groups) for c in g]
    with torch.no_grad():
        packed = packed_forward_logprobs(model, seqs, temperature=temperature, compute_entropy=False)
    mask = torch.cat([torch.tensor(c.mask, dtype=torch.bool) for c in completions])
    engine_lp = torch.cat([torch.tensor(c.logprobs) for c in completions])
    assert packed.logprobs.numel() == engine_lp.numel() > int(mask.sum()) > 0
    torch.testing.assert_close(packed.logprobs[mask], engine_lp[mask], rtol=0, atol=2e-5)
    assert torch.all(engine_lp[~mask] == 0)

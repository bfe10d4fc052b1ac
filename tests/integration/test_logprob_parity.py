"""generation.logprob_parity=exact end to end on the CPU (Triton's interpreter): the engine's sampling logprobs of a
mixed batch (prompts of different lengths, several completions each, prefill and decode steps) equal the training
forward's recompute bit for bit, with the completions packed in other rows and orders (and for multi-turn
completions, whose later turns attend over their cached prefix); in fast mode the difference is reported. The exact forward's backward gives the fast forward's gradients (float32, to rounding). And the update
that takes the engine's logprobs as its old ones (no recompute pass) computes the same loss, metrics and gradients,
bit for bit, as the one that recomputes them. Runs in a child process (the interpreter must be on
when Triton first sees the kernels); skips without Triton.
"""

from __future__ import annotations

import os

import pytest
import torch
from tests.helpers.engine_checks import recompute_in_rows
from tests.helpers.triton_interpreter import patch_interpreter_index, run_interpreted

PROMPTS = ("Say the digit 3", "What is 2 + 3? The answer", "hi", "Count 1 2 3 4 5 6 7 8 9 then")


def _sample(mode: str, dtype: torch.dtype, n: int = 3, max_tokens: int = 6, prompts=PROMPTS):
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import tiny_model

    from cohort.engine import CohortEngine
    from cohort.forward.invariant.parity import set_logprob_parity
    from cohort.types import SamplingParams

    tok = make_tiny_tokenizer()
    model = tiny_model(tok, seed=1).eval().to(dtype)
    set_logprob_parity(model, mode)
    ids = [tok(t)["input_ids"] for t in prompts]
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=16, max_model_len=128)
    groups = engine.generate(ids, SamplingParams(n=n, max_tokens=max_tokens, temperature=0.7, seed=5))
    return model, [(p, c.token_ids) for p, g in zip(ids, groups) for c in g], [c.logprobs for g in groups for c in g]


def _check_engine() -> None:
    from cohort.forward.invariant import attention

    # contexts over several key tiles and splits at these lengths (the kernels read the constants at launch)
    attention.ATTN_TILE, attention.SPLIT_KEYS = 16, 16
    # float32 shows every change of a sum's order (bfloat16's rounding hides most at these sizes: the kernel tests
    # and the GPU test cover it)
    model, seqs, sampled = _sample("exact", torch.float32, n=2)
    engine_lp = torch.cat([torch.tensor(s) for s in sampled])
    rows = [[6, 1, 4], [0, 7, 2, 5, 3]]  # two rows, neither the engine's order nor its batches
    trainer_lp = recompute_in_rows(model, seqs, rows, 0.7)
    assert trainer_lp.numel() == engine_lp.numel() > 40
    diff = (trainer_lp - engine_lp).abs().max().item()
    assert diff == 0, f"exact parity: max |engine - trainer| = {diff} with rows {rows}"
    model, seqs, sampled = _sample("fast", torch.bfloat16)
    fast = (recompute_in_rows(model, seqs, [list(range(len(seqs)))], 0.7) - torch.cat([torch.tensor(s) for s in sampled]))
    print(f"fast mode: max |engine - trainer| = {fast.abs().max().item():.3g}, mean {fast.abs().mean().item():.3g}")


def _check_turns() -> None:
    """A 3-turn conversation: the later turns' new tokens attend over their cached prefix through the block tables
    (the paged kernel), the trainer sees one packed sequence; the model's tokens' logprobs are equal."""
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import tiny_model

    from cohort.engine import CohortEngine
    from cohort.forward.invariant import attention
    from cohort.forward.invariant.parity import set_logprob_parity
    from cohort.types import SamplingParams

    attention.ATTN_TILE, attention.SPLIT_KEYS = 16, 16
    tok = make_tiny_tokenizer()
    model = tiny_model(tok, seed=1).eval()
    set_logprob_parity(model, "exact")
    prompts = [tok(t)["input_ids"] for t in PROMPTS[:2]]
    context = {1: tok(" -> 5.")["input_ids"], 2: tok(" #### 72 the")["input_ids"]}  # stand-ins for tool results
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=16, max_model_len=128)
    params = SamplingParams(n=2, max_tokens=24, temperature=0.7, seed=5, stop_token_ids=tuple(range(3, 300)))
    completions = [c for g in engine.generate_turns(prompts, params, lambda turn: context.get(turn.turn)) for c in g]
    assert all(c.turns == 3 for c in completions)
    seqs = [(p, c.token_ids) for p, c in zip([p for p in prompts for _ in range(2)], completions, strict=True)]
    trainer_lp = recompute_in_rows(model, seqs, [[3, 0], [2, 1]], 0.7)
    mask = torch.cat([torch.tensor(c.mask, dtype=torch.bool) for c in completions])
    engine_lp = torch.cat([torch.tensor(c.logprobs) for c in completions])
    assert int(mask.sum()) >= 8
    assert (trainer_lp[mask] - engine_lp[mask]).abs().max().item() == 0


class _Capture:
    """The optimizer and scheduler stand-in: keeps the first update's gradients, changes no weight."""

    def __init__(self, params):
        self.params, self.grads = params, []

    def step(self):
        self.grads.append([p.grad.clone() for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def get_last_lr(self):
        return [0.0]


def _update(model, seqs, sampled, parity: str):
    import contextlib

    from cohort.algorithms import build_policy_loss
    from cohort.types import RolloutBatch
    from cohort.update import PolicyUpdater, UpdateSettings

    n = len(seqs)
    batch = RolloutBatch(
        prompt_ids=[p for p, _ in seqs], completion_ids=[c for _, c in seqs], sampling_logprobs=sampled,
        finish_reasons=["stop"] * n, completions_text=[""] * n, prompts=[""] * n, rewards_per_func=torch.zeros(n, 1),
        rewards=torch.zeros(n), advantages=torch.tensor([0.9, -0.3, 0.5, -0.7])[:n], loss_mask_keep=[True] * n, group_size=2)
    capture = _Capture(list(model.parameters()))
    loss = build_policy_loss("grpo", {"sampler_is_mode": "token_truncate"})
    settings = UpdateSettings(mini_batches=2, num_iterations=1, token_budget=100_000, temperature=0.7,
                              max_grad_norm=1e9, max_completion_length=8, logprob_parity=parity)
    updater = PolicyUpdater(model, capture, capture, loss, settings)
    calls = []
    recompute = updater._logprobs_of
    updater._logprobs_of = lambda *a: calls.append(1) or recompute(*a)  # type: ignore[method-assign]
    metrics = updater.update(batch, lambda name: contextlib.nullcontext())
    return metrics, capture.grads, len(calls)


def _gradients(model, seqs, mode: str) -> list[torch.Tensor]:
    """The parameters' gradients of the logprobs' and entropies' sum under parity `mode` (the model re-marked)."""
    from cohort.forward.invariant.parity import set_logprob_parity
    from cohort.forward.packing import packed_forward_logprobs

    set_logprob_parity(model, mode)
    model.zero_grad()
    packed = packed_forward_logprobs(model, seqs, temperature=0.7, share_prompts=False)
    (packed.logprobs.sum() + 0.1 * packed.entropy.sum()).backward()
    return [p.grad.clone() for p in model.parameters()]


def _check_update() -> None:
    model, seqs, sampled = _sample("exact", torch.float32, n=2, max_tokens=5, prompts=PROMPTS[:2])
    model.train()
    # the exact forward's backward (torch's maths on the kernels' forward values) is the fast one's gradient
    for exact, fast in zip(_gradients(model, seqs, "exact"), _gradients(model, seqs, "fast"), strict=True):
        torch.testing.assert_close(exact, fast, atol=1e-4, rtol=1e-3)
    from cohort.forward.invariant.parity import set_logprob_parity

    set_logprob_parity(model, "exact")
    model.zero_grad(set_to_none=True)
    skipped, grads_skipped, recomputes = _update(model, seqs, sampled, "exact")
    assert recomputes == 0  # the engine's logprobs are the old ones
    full, grads_full, recomputes = _update(model, seqs, sampled, "fast")  # the same exact forward, recomputed
    assert recomputes == 1
    assert skipped == full, (skipped, full)
    for a, b in zip(grads_skipped, grads_full, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    print(f"loss {skipped['loss']!r} unchanged without the recompute")


def test_exact_engine_logprobs_equal_the_trainer_recompute_bitwise(monkeypatch):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    monkeypatch.setenv("COHORT_PARITY_PART", "engine")
    run_interpreted(__file__, "engine ok", timeout_s=600)


def test_exact_parity_holds_for_continued_turns_over_a_cached_prefix(monkeypatch):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    monkeypatch.setenv("COHORT_PARITY_PART", "turns")
    run_interpreted(__file__, "turns ok", timeout_s=600)


def test_exact_update_without_the_recompute_has_the_same_loss(monkeypatch):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    monkeypatch.setenv("COHORT_PARITY_PART", "update")
    run_interpreted(__file__, "update ok", timeout_s=600)


if __name__ == "__main__":
    patch_interpreter_index()
    part = os.environ.get("COHORT_PARITY_PART", "engine")
    {"engine": _check_engine, "turns": _check_turns, "update": _check_update}[part]()
    print(f"{part} ok")

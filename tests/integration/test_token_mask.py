"""The per-token loss mask of multi-turn completions, through the real update (packed forward, every loss).

Tool-result (context) tokens sit inside a completion, so the packed forward computes their logprobs and
entropy like any other token's; the mask must keep them out of everything: the loss, its gradient, the
normaliser `num_tokens` and the metrics. The check: perturb the logprobs, entropy and engine logprobs of the
masked positions before the loss sees them; the parameter gradients and every metric must not change, and
d loss / d logprob must be exactly 0 there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.integration.engine_models import random_prompts, tiny_model

from cohort.algorithms import build_policy_loss
from cohort.rollout import RolloutBatch
from cohort.update import PolicyUpdater, UpdateSettings

# Two groups of two: multi-turn completions (model tokens, then tool-result tokens, then model tokens) and
# one single-turn completion (mask None: all its tokens are the model's).
MASKS = [
    [1, 1, 1, 0, 0, 0, 0, 1, 1],
    [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1],
    None,
    [1, 0, 0, 1, 1, 1],
]
LENGTHS = [9, 11, 7, 6]

LOSSES = [
    ("dapo", {}),
    ("grpo", {}),
    ("dr_grpo", {}),
    ("cispo", {}),
    ("sapo", {}),
    ("grpo", {"importance_sampling_level": "sequence"}),  # GSPO
    ("vespo", {"sampler_is_mode": "token_truncate"}),
    ("dapo", {"entropy_coef": 0.01, "top_entropy_quantile": 0.5, "sampler_is_mode": "token_mask"}),
    ("dapo", {"beta": 0.05, "off_policy_mask_threshold": 0.5}),
]


def make_batch(keep: list[bool] | None = None) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = random_prompts([5, 5, 8, 8])
    completions = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in LENGTHS]
    sampling = [(-torch.rand(n, generator=gen) * 3).tolist() for n in LENGTHS]
    sampling = [[lp if (m is None or m[k]) else 0.0 for k, lp in enumerate(row)] for row, m in zip(sampling, MASKS)]
    return RolloutBatch(
        prompt_ids=prompts, completion_ids=completions, sampling_logprobs=sampling,
        finish_reasons=["stop"] * 4, completions_text=[""] * 4, prompts=[""] * 4,
        rewards_per_func=torch.zeros(4, 1), rewards=torch.tensor([1.0, 0.0, 0.5, 0.0]),
        advantages=torch.tensor([0.7, -0.7, 0.9, -0.9]), loss_mask_keep=keep or [True] * 4, group_size=2,
        completion_masks=list(MASKS))


class _Capture:
    """Stands in for the optimizer and scheduler: keeps the gradients the update would step with."""

    def __init__(self, params):
        self.params, self.grads = params, None

    def step(self):
        if self.grads is None:
            self.grads = [p.grad.clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def get_last_lr(self):
        return [0.0]


class _PerturbMasked:
    """Wraps a loss: adds noise to logprobs, entropy and engine logprobs where the mask is 0, records inputs."""

    def __init__(self, loss_fn, scale: float):
        self.loss_fn, self.scale, self.seen = loss_fn, scale, []

    def __call__(self, inputs):
        off = (1 - inputs.mask) * torch.randn(inputs.mask.shape, generator=torch.Generator().manual_seed(1))
        noise = self.scale * off
        inputs = dataclasses.replace(
            inputs, logprobs=inputs.logprobs + noise, entropy=inputs.entropy + noise.abs(),
            sampling_logprobs=inputs.sampling_logprobs - noise,
            ref_logprobs=None if inputs.ref_logprobs is None else inputs.ref_logprobs + noise)
        if inputs.logprobs.requires_grad:
            inputs.logprobs.retain_grad()
        self.seen.append(inputs)
        return self.loss_fn(inputs)


def run_update(loss_name: str, params: dict, scale: float, keep=None):
    model = tiny_model("llama").train()
    reference = tiny_model("llama", seed=3) if params.get("beta") else None
    capture = _Capture([p for p in model.parameters()])
    loss = _PerturbMasked(build_policy_loss(loss_name, params), scale)
    settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=100_000, temperature=1.0,
                              max_grad_norm=1e9, max_completion_length=16)
    updater = PolicyUpdater(model, capture, capture, loss, settings, reference=reference)
    metrics = updater.update(make_batch(keep), _no_timer)
    return capture.grads, metrics, loss.seen


class _no_timer_cls:
    def __call__(self, name):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_no_timer = _no_timer_cls()


@pytest.mark.parametrize(("loss_name", "params"), LOSSES, ids=[f"{n}-{'-'.join(p) or 'plain'}" for n, p in LOSSES])
def test_masked_tokens_get_zero_gradient_and_leave_metrics_unchanged(loss_name, params):
    clean_grads, clean_metrics, seen = run_update(loss_name, params, scale=0.0)
    noisy_grads, noisy_metrics, _ = run_update(loss_name, params, scale=2.0)
    assert any(g.abs().sum() > 0 for g in clean_grads)
    for a, b in zip(clean_grads, noisy_grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)
    assert noisy_metrics.keys() == clean_metrics.keys()
    for k in clean_metrics:
        assert noisy_metrics[k] == pytest.approx(clean_metrics[k], rel=1e-6, abs=1e-9, nan_ok=True), k
    inputs = seen[0]
    model_tokens = sum(sum(m) if m is not None else n for m, n in zip(MASKS, LENGTHS))
    assert inputs.num_tokens == model_tokens == int(inputs.mask.sum())


@pytest.mark.parametrize(("loss_name", "params"), LOSSES, ids=[f"{n}-{'-'.join(p) or 'plain'}" for n, p in LOSSES])
def test_loss_gradient_wrt_logprobs_is_zero_on_context_tokens(loss_name, params):
    _, _, seen = run_update(loss_name, params, scale=0.0)
    inputs = seen[0]
    logprobs = inputs.logprobs.detach().clone().requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(2))
    out = build_policy_loss(loss_name, params)(dataclasses.replace(inputs, logprobs=logprobs, old_logprobs=old))
    (grad,) = torch.autograd.grad(out.loss, logprobs)
    mask = inputs.mask.bool()
    assert torch.all(grad[~mask] == 0)
    assert torch.count_nonzero(grad[mask]) > 0


def test_mask_truncated_zeroes_a_whole_completion_and_single_turn_is_all_ones():
    batch = make_batch(keep=[True, False, True, True])
    assert batch.token_mask(1) == [0] * LENGTHS[1]
    assert batch.token_mask(2) == [1] * LENGTHS[2]  # single-turn: every token is the model's
    assert batch.token_mask(0) == MASKS[0]
    for i in range(4):  # the update's shortcuts agree with the mask itself
        assert batch.loss_token_count(i) == sum(batch.token_mask(i))
        assert batch.all_tokens_trained(i) == (i == 2)  # only the kept single-turn row is all ones by construction
        assert not batch.all_tokens_trained(i) or all(batch.token_mask(i))
    _, _, seen = run_update("dapo", {}, scale=0.0, keep=[True, False, True, True])
    assert seen[0].num_tokens == sum(MASKS[0]) + LENGTHS[2] + sum(MASKS[3])

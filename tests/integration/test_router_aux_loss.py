"""The MoE router load-balancing loss (issue 38) with TRL's meaning of `router_aux_loss_coef`: None -> the model
config's own coefficient, a number -> that coefficient, 0.0 -> off. The packed forward computes it over a packed
row's tokens with transformers' `load_balancing_loss_func`; the update adds coef * aux_loss, weighted by each
micro-batch's share of the mini-batch's tokens, and logs `aux_loss`."""

from __future__ import annotations

import math

import pytest
import torch
from tests.integration.engine_models import random_prompts, tiny_model
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from cohort import GRPOConfig
from cohort.algorithms import build_policy_loss
from cohort.config import CohortConfig, apply_overrides
from cohort.errors import ConfigError
from cohort.forward.packing import packed_forward_logprobs
from cohort.rollout import RolloutBatch
from cohort.setup.settings import router_aux_loss_coef, update_settings
from cohort.trl_compat.fields import TABLE, kind
from cohort.update import PolicyUpdater, UpdateSettings

PROMPT_LENS, COMPLETION_LENS = [5, 7, 4], [6, 3, 9]


def _sequences():
    gen = torch.Generator().manual_seed(0)
    prompts = random_prompts(PROMPT_LENS)
    return [(p, torch.randint(3, 96, (n,), generator=gen).tolist()) for p, n in zip(prompts, COMPLETION_LENS)]


def _moe():
    return tiny_model("qwen3_moe").float()


def test_packed_aux_loss_equals_transformers_unpacked():
    """Hand check: each sequence alone through the HF model, its router logits gathered, one
    load_balancing_loss_func over all the tokens; the packed row's value must be the same number."""
    model, seqs = _moe(), _sequences()
    with torch.no_grad():
        packed = packed_forward_logprobs(model, seqs, router_aux_loss=True)
        alone = [model(input_ids=torch.tensor([list(prompt) + completion]), output_router_logits=True).router_logits
                 for prompt, completion in seqs]
        per_layer = tuple(torch.cat(layer) for layer in zip(*alone, strict=True))  # every sequence's tokens
        expected = load_balancing_loss_func(per_layer, 8, 2, None)
    assert packed.aux_loss is not None and packed.row_tokens == sum(PROMPT_LENS) + sum(COMPLETION_LENS)
    assert float(expected) > 0
    torch.testing.assert_close(packed.aux_loss, expected, rtol=1e-5, atol=1e-6)
    # a dense model never asks for router logits
    dense = packed_forward_logprobs(tiny_model("llama"), seqs)
    assert dense.aux_loss is None


def test_packed_aux_loss_equals_trl_model_forward():
    """TRL 1.16 asks the model for `output_router_logits=True` on its padded micro-batch (left-padded prompts,
    right-padded completions, attention_mask over the real tokens) and adds `outputs.aux_loss`: same value."""
    pytest.importorskip("trl", reason="cross-check with TRL: pip install trl==1.16.0")
    model, seqs = _moe(), _sequences()
    p_max, c_max = max(PROMPT_LENS), max(COMPLETION_LENS)
    ids, mask = [], []
    for prompt, completion in seqs:
        pad_p, pad_c = p_max - len(prompt), c_max - len(completion)
        ids.append([0] * pad_p + list(prompt) + completion + [0] * pad_c)
        mask.append([0] * pad_p + [1] * (len(prompt) + len(completion)) + [0] * pad_c)
    with torch.no_grad():
        trl_aux = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                        output_router_logits=True).aux_loss
        ours = packed_forward_logprobs(model, seqs, router_aux_loss=True).aux_loss
    torch.testing.assert_close(ours, trl_aux, rtol=1e-5, atol=1e-6)


def test_coefficient_resolution_and_check():
    moe, dense = _moe(), tiny_model("llama")
    cfg = CohortConfig()
    assert cfg.loss.router_aux_loss_coef is None
    assert router_aux_loss_coef(cfg, moe) == pytest.approx(moe.config.router_aux_loss_coef) == pytest.approx(0.001)
    assert update_settings(cfg, moe).router_aux_loss_coef == pytest.approx(0.001)
    assert router_aux_loss_coef(cfg, dense) == 0.0  # dense: nothing changes
    for value, want in ((0.0, 0.0), (0.25, 0.25)):
        assert router_aux_loss_coef(apply_overrides(CohortConfig(), [f"loss.router_aux_loss_coef={value}"]),
                                    moe) == want
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        router_aux_loss_coef(apply_overrides(CohortConfig(), ["loss.router_aux_loss_coef=0.1"]), dense)
    for bad in ("-0.1", "nan"):
        with pytest.raises(ConfigError, match="router_aux_loss_coef"):
            apply_overrides(CohortConfig(), [f"loss.router_aux_loss_coef={bad}"]).validate()
    apply_overrides(CohortConfig(), ["loss.router_aux_loss_coef=0.01"]).validate()  # and the loss builds


class _Capture:
    """Stands in for the optimizer and scheduler: keeps the gradients the update would step with."""

    def __init__(self, params):
        self.params, self.grads = params, None

    def step(self):
        if self.grads is None:
            self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def get_last_lr(self):
        return [0.0]


class _Timer:
    def __call__(self, name):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _batch(seqs, advantages) -> RolloutBatch:
    n = len(seqs)
    return RolloutBatch(
        prompt_ids=[p for p, _ in seqs], completion_ids=[c for _, c in seqs],
        sampling_logprobs=[[-1.0] * len(c) for _, c in seqs], finish_reasons=["stop"] * n,
        completions_text=[""] * n, prompts=[""] * n, rewards_per_func=torch.zeros(n, 1),
        rewards=torch.zeros(n), advantages=torch.tensor(advantages), loss_mask_keep=[True] * n, group_size=n)


def _update(coef: float, seqs, advantages, token_budget: int = 100_000):
    model = _moe().train()
    capture = _Capture(list(model.parameters()))
    settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=token_budget, temperature=1.0,
                              max_grad_norm=1e9, max_completion_length=16, router_aux_loss_coef=coef)
    updater = PolicyUpdater(model, capture, capture, build_policy_loss("dapo", {}), settings)
    metrics = updater.update(_batch(seqs, advantages), _Timer())
    return capture.grads, metrics, model


def test_update_adds_coef_times_aux_loss_and_logs_it():
    """The gradient with a coefficient is the policy gradient plus coef * d aux_loss; 0.0 adds nothing, no metric."""
    seqs, adv = _sequences(), [0.8, -0.5, 0.3]
    coef = 0.5
    off_grads, off_metrics, _ = _update(0.0, seqs, adv)
    on_grads, on_metrics, model = _update(coef, seqs, adv)
    assert "aux_loss" not in off_metrics
    aux = packed_forward_logprobs(model, seqs, router_aux_loss=True).aux_loss
    assert aux is not None
    assert on_metrics["aux_loss"] == pytest.approx(float(aux.detach()), rel=1e-5)
    model.zero_grad(set_to_none=True)
    (coef * aux).backward()
    names = [n for n, _ in model.named_parameters()]
    router = [i for i, n in enumerate(names) if n.endswith("mlp.gate.weight")]
    assert router and any(on_grads[i].abs().sum() > 0 for i in router)
    for i, p in enumerate(model.parameters()):
        hand = torch.zeros_like(p) if p.grad is None else p.grad
        torch.testing.assert_close(on_grads[i] - off_grads[i], hand, rtol=1e-4, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(on_grads, off_grads))


def test_two_micro_batches_give_the_gradient_of_one():
    """Each micro-batch's term is weighted by its share of the mini-batch's tokens. Two micro-batches with the same
    routing statistics (the same two sequences twice) then add up to exactly the whole-batch gradient; advantages
    are 0, so the gradient is the router loss's alone."""
    a, b = _sequences()[:2]
    seqs = [a, b, a, b]
    budget = len(a[0]) + len(a[1]) + len(b[0]) + len(b[1])
    one_grads, one_metrics, _ = _update(1.0, seqs, [0.0] * 4)
    two_grads, two_metrics, _ = _update(1.0, seqs, [0.0] * 4, token_budget=budget)
    assert any(g.abs().sum() > 0 for g in one_grads)
    assert math.isclose(one_metrics["aux_loss"], two_metrics["aux_loss"], rel_tol=1e-5)
    for g1, g2 in zip(one_grads, two_grads):
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-7)


def test_trl_facade_maps_router_aux_loss_coef():
    assert kind(TABLE["router_aux_loss_coef"][1]) != "reject"
    assert GRPOConfig(output_dir="out", max_steps=1).to_cohort().loss.router_aux_loss_coef is None
    for value in (0.0, 0.02):
        assert GRPOConfig(output_dir="out", max_steps=1, router_aux_loss_coef=value).to_cohort().loss.router_aux_loss_coef == value

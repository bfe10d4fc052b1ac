"""Invariant: the token budget changes speed, never the maths. The same rollouts, processed as one packed
micro-batch or cut into many (gradient accumulation), give the same gradient for every loss family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.config import apply_overrides
from cohort.rollout import collect_rollouts
from cohort.timing import PhaseTimer
from cohort.update import PolicyUpdater, UpdateSettings


class GradRecorder:
    """Stands in for the optimiser: keeps the accumulated gradients, changes no weight."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


class NoSchedule:
    def step(self):
        pass

    def get_last_lr(self):
        return [0.0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo"])
def test_micro_batching_gives_the_whole_batch_gradient(tmp_path, loss_type):
    cfg = apply_overrides(toy_config(tmp_path, steps=1), [f"loss.loss_type={loss_type}"]).validate()
    comp = toy_components(cfg)
    from cohort.data import PromptSampler

    sampler = PromptSampler(len(comp.train_data), cfg.train.prompts_per_step, seed=0)
    batch = collect_rollouts(comp.engine, comp.tokenizer, lambda k: comp.train_data.batch(sampler.take(k)),
                             cfg.train.prompts_per_step, dataclasses.replace(comp.sampling_params, seed=3),
                             comp.reward_runner, advantage_kwargs=comp.advantage_kwargs, trainer_state={})
    assert batch.advantages.abs().sum() > 0
    grads = {}
    for budget in (100_000, 40):  # everything in one row / about one sequence per micro-batch
        recorder = GradRecorder(comp.policy)
        settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=budget, temperature=1.0,
                                  max_grad_norm=1e9, max_completion_length=cfg.generation.max_completion_length,
                                  num_generations=cfg.generation.num_generations)
        PolicyUpdater(comp.policy, recorder, NoSchedule(), comp.loss_fn, settings).update(batch, PhaseTimer())
        grads[budget] = recorder.grads
    whole, split = grads[100_000], grads[40]
    assert whole.keys() == split.keys() and whole
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7, msg=name)

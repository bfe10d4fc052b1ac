"""Invariant: the token budget and the row layout change speed, never the maths. The same rollouts, processed
as one packed micro-batch or cut into many (gradient accumulation), with every prompt copied per completion or
shared by its group (train.share_prompts), give the same gradient for every loss family."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.config import apply_overrides
from cohort.rollout import collect_rollouts
from cohort.run.timing import PhaseTimer
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
def test_micro_batching_gives_the_whole_batch_gradient(tmp_path, loss_type, monkeypatch):
    cfg = apply_overrides(toy_config(tmp_path, steps=1), [f"loss.loss_type={loss_type}"]).validate()
    comp = toy_components(cfg)
    from cohort.data import PromptSampler

    sampler = PromptSampler(len(comp.train_data), cfg.train.prompts_per_step, seed=0)
    batch = collect_rollouts(comp.engine, comp.tokenizer, lambda k: comp.train_data.batch(sampler.take(k)),
                             cfg.train.prompts_per_step, dataclasses.replace(comp.sampling_params, seed=3),
                             comp.reward_runner, advantage_kwargs=comp.advantage_kwargs, trainer_state={})
    assert batch.advantages.abs().sum() > 0
    assert cfg.generation.num_generations > 1  # groups share their prompts in the shared layout
    from cohort.forward import packing

    layouts = []
    real = packing.pack_shared_layout
    monkeypatch.setattr(packing, "pack_shared_layout", lambda seqs: layouts.append(real(seqs)) or layouts[-1])
    grads = {}
    # everything in one row / about one sequence per micro-batch / a few groups per row; the plain layout and
    # the one where a group's completions share one copy of its prompt (train.share_prompts)
    for budget, share in ((100_000, False), (40, False), (100_000, True), (40, True), (120, True)):
        recorder = GradRecorder(comp.policy)
        settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=budget, temperature=1.0,
                                  max_grad_norm=1e9, max_completion_length=cfg.generation.max_completion_length,
                                  share_prompts=share)
        PolicyUpdater(comp.policy, recorder, NoSchedule(), comp.loss_fn, settings).update(batch, PhaseTimer())
        grads[budget, share] = recorder.grads
        if share and budget > 40:  # rows of whole groups: the shared layout ran
            assert layouts and all(layout is not None for layout in layouts)
        layouts.clear()
    whole = grads[100_000, False]
    assert whole
    for key, other in grads.items():
        assert other.keys() == whole.keys(), key
        for name in whole:
            torch.testing.assert_close(other[name], whole[name], rtol=1e-4, atol=1e-7, msg=f"{key} {name}")

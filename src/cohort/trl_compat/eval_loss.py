"""TRL's `eval_loss` for `GRPOTrainer.evaluate()`: the run's GRPO objective on the evaluation prompts.

TRL evaluates by generating `num_generations_eval` completions per prompt (default `num_generations`), scoring
them, normalising the rewards into advantages within each group as in training, and computing the loss without
an update. Here the same: cohort's rollout (`collect_rollouts`, the run's reward functions and advantage
estimator, sampled at the training temperature with the run's seed) and the run's loss function. No update
lies between sampling and scoring, so the old log-probabilities are the policy's own (ratio 1); the engine's
log-probabilities stand for the policy's (they agree to float precision). Two terms are left out, each 0 at
ratio 1 in TRL's default setting: the KL to the reference (beta, scored as 0) and the entropy bonus.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from cohort.algorithms.loss_io import LossInputs
from cohort.rollout import collect_rollouts
from cohort.types import TrainerState


@torch.no_grad()
def eval_loss(comp: Any, cfg: Any, data: Any, num_generations: int) -> float:
    """The loss of `cfg.loss.loss_type` on `num_generations` completions per prompt of `data` (encoded)."""
    if len(data) == 0:
        return float("nan")
    params = dataclasses.replace(comp.sampling_params, n=max(1, int(num_generations)), seed=cfg.train.seed)
    was_training = comp.policy.training
    comp.policy.eval()
    try:
        batch = collect_rollouts(
            comp.engine, comp.tokenizer, lambda k: data.batch(list(range(k))), len(data), params,
            comp.reward_runner, advantage_kwargs=comp.advantage_kwargs,
            trainer_state=TrainerState(global_step=-1, max_steps=cfg.train.max_steps, is_eval=True),
            mask_truncated_completions=cfg.generation.mask_truncated_completions, turn_loop=comp.turn_loop)
    finally:
        if was_training:
            comp.policy.train()
    rows = len(batch)
    width = max(1, max((len(ids) for ids in batch.completion_ids), default=1))
    logprobs = torch.zeros(rows, width)
    mask = torch.zeros(rows, width)
    for i, lp in enumerate(batch.sampling_logprobs):
        logprobs[i, :len(lp)] = torch.tensor([0.0 if v is None else float(v) for v in lp])
        token_mask = batch.token_mask(i)
        mask[i, :len(token_mask)] = torch.tensor(token_mask, dtype=torch.float32)
    logprobs = torch.nan_to_num(logprobs, nan=0.0)
    out = comp.loss_fn(LossInputs(
        logprobs=logprobs, mask=mask, advantages=batch.advantages.float(), old_logprobs=logprobs,
        ref_logprobs=logprobs, entropy=torch.zeros_like(logprobs),
        max_completion_length=cfg.generation.max_completion_length))
    return float(out.metrics.get("policy_loss", out.loss))

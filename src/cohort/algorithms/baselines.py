"""Outcome-reward estimators beyond GRPO and RLOO: REINFORCE++ (and its group baseline), ReMax, OPO, GPG.

Each owns its scaling and ignores ``scale_rewards``; each follows the outcome-reward function of the same
name in verl's ``verl/trainer/ppo/core_algos.py`` (``compute_<name>_outcome_advantage``), with cohort's
rule for unscorable rows (NaN reward: left out of every statistic, advantage 0). The scaling std they return
(behind ``frac_reward_zero_std`` and DAPO's dynamic-sampling filter) is the row's group std, as under
``scale_rewards="none"``: a group whose rewards are all equal counts as "zero std" whatever the estimator.

With ``r`` a row's combined reward, ``mean_g`` its group's mean, ``len`` its trained token count:

- ``reinforce_plus_plus`` (REINFORCE++, arXiv:2501.03262): ``A = whiten_B(r)``, the batch's
  ``(r - mean_B) / sqrt(var_B + 1e-8)``, each row weighted by its tokens (verl's ``masked_whiten`` over the
  response tokens); no group baseline.
- ``reinforce_plus_plus_baseline``: ``A = whiten_B(r - mean_g)`` (the same whitening of group-centred rewards).
- ``remax`` (ReMax, arXiv:2310.10505): ``A = r - r_greedy``, the reward of one greedy completion of the
  prompt (the rollout generates and scores it; it is not trained on).
- ``opo`` (On-Policy RL with Optimal reward baseline, arXiv:2505.23585): ``A = r - sum_g(len r) / sum_g(len)``.
- ``gpg`` (Group Policy Gradient, arXiv:2504.02546): ``A = alpha (r - mean_g) / f_norm`` with
  ``alpha = N / max(1, M)``, ``N`` the batch's scorable rows and ``M`` those with a non-zero reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .estimator_base import AdvantageEstimator, group_std_rows, weighted_whiten


@dataclass
class ReinforcePlusPlusEstimator(AdvantageEstimator):
    """REINFORCE++ (Hu, arXiv:2501.03262), outcome form: the rewards whitened over the whole batch.

    ``A = (r - mean_B) / sqrt(var_B + whiten_eps)``, ``mean_B`` and ``var_B`` (Bessel) over the batch's
    scorable rows, each weighted by its token count when ``token_weighted`` and the caller gives lengths
    (verl's ``compute_reinforce_plus_plus_outcome_advantage``: ``masked_whiten`` of the returns over the
    response tokens, with ``gamma = 1``, so every token of a row carries its outcome reward). Without lengths
    (a direct call), each row counts once.

    Not supported: verl's ``gamma < 1`` (a per-token discount of the outcome) and KL in the reward (verl's
    ``use_kl_in_reward``): both make the advantage differ token by token, while cohort's update takes one
    advantage per completion and computes reference log-probs after the rollout. Use ``loss.beta`` (KL in
    the loss, verl's ``use_kl_loss``) instead.
    """

    name: ClassVar[str] = "reinforce_plus_plus"
    needs_lengths: ClassVar[bool] = True

    token_weighted: bool = True
    whiten_eps: float = 1e-8

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        """No group baseline: the batch whitening centres the rewards."""
        return torch.zeros_like(grouped)

    def advantages(self, rewards: torch.Tensor, group_size: int, *, scale_rewards: str, eps: float,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] rewards (and [N] token counts) -> ([N] whitened advantages, [N] group std)."""
        grouped = rewards.view(-1, group_size)
        centred = (grouped - self.baseline(grouped)).reshape(-1)
        weights = lengths if self.token_weighted and lengths is not None else None
        return weighted_whiten(centred, weights, self.whiten_eps), group_std_rows(rewards, group_size)


@dataclass
class ReinforcePlusPlusBaselineEstimator(ReinforcePlusPlusEstimator):
    """REINFORCE++-baseline (arXiv:2501.03262): the group mean subtracted, then whitened over the batch.

    ``A = whiten_B(r - mean_g)`` (verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``: the
    centred scores whitened with ``masked_whiten`` over the response tokens, which centres them once more on
    their token-weighted batch mean).
    """

    name: ClassVar[str] = "reinforce_plus_plus_baseline"

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        return torch.nanmean(grouped, dim=1, keepdim=True)


@dataclass
class ReMaxEstimator(AdvantageEstimator):
    """ReMax (Li et al., arXiv:2310.10505): the baseline is the reward of the prompt's greedy completion.

    ``A = r - r_greedy`` (verl's ``compute_remax_outcome_advantage``: ``returns - reward_baselines``, no
    scaling). The rollout generates one extra greedy completion per prompt (temperature 0, n = 1), scores it
    with the same reward functions and weights, and does not train on it. An unscorable greedy completion
    (every function None) gives its prompt's rows advantage 0.
    """

    name: ClassVar[str] = "remax"
    needs_greedy_baseline: ClassVar[bool] = True

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        raise ValueError("remax's baseline is the reward of a greedy completion per prompt, not a function of "
                         "the group's rewards: call advantages(..., baseline_rewards=[P]).")

    def advantages(self, rewards: torch.Tensor, group_size: int, *, scale_rewards: str, eps: float,
                   baseline_rewards: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] rewards and [P] greedy rewards -> ([N] ``r - r_greedy``, [N] group std)."""
        grouped = rewards.view(-1, group_size)
        if baseline_rewards is None or baseline_rewards.numel() != grouped.shape[0]:
            got = None if baseline_rewards is None else tuple(baseline_rewards.shape)
            raise ValueError(f"remax needs baseline_rewards with one greedy reward per prompt ({grouped.shape[0]}), "
                             f"got {got}; collect_rollouts generates and scores the greedy completions.")
        greedy = baseline_rewards.reshape(-1, 1).to(grouped.dtype)
        return (grouped - greedy).reshape(-1), group_std_rows(rewards, group_size)


@dataclass
class OPOEstimator(AdvantageEstimator):
    """OPO (Hao et al., arXiv:2505.23585): the length-weighted mean reward of the group as the baseline.

    ``b = sum_g(len_i r_i) / sum_g(len_i)`` over the group's scorable rows, ``A = r - b`` with no scaling
    (verl's ``compute_opo_outcome_advantage``, ``len`` = the response mask's sum). Needs the lengths.
    """

    name: ClassVar[str] = "opo"
    needs_lengths: ClassVar[bool] = True

    def advantages(self, rewards: torch.Tensor, group_size: int, *, scale_rewards: str, eps: float,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] rewards and [N] token counts -> ([N] ``r - b``, [N] group std)."""
        if lengths is None or lengths.numel() != rewards.numel():
            got = None if lengths is None else tuple(lengths.shape)
            raise ValueError(f"opo needs lengths, one token count per completion ({rewards.numel()}), got {got}; "
                             "collect_rollouts passes them.")
        grouped = rewards.view(-1, group_size)
        valid = ~torch.isnan(grouped)
        weights = torch.where(valid, lengths.view(-1, group_size).to(grouped.dtype), torch.zeros_like(grouped))
        total = (weights * torch.nan_to_num(grouped, nan=0.0)).sum(dim=1, keepdim=True)
        # a group with no scorable tokens has no baseline: 0/0 = NaN, advantage 0
        baseline = total / weights.sum(dim=1, keepdim=True)
        return (grouped - baseline).reshape(-1), group_std_rows(rewards, group_size)


@dataclass
class GPGEstimator(AdvantageEstimator):
    """GPG (Chu et al., arXiv:2504.02546): the group-centred reward, rescaled for the rows without signal.

    ``A = alpha (r - mean_g) / f_norm`` with ``alpha = N / max(1, M)``: ``N`` the batch's scorable rows and
    ``M`` those whose reward is non-zero (verl's ``compute_gpg_outcome_advantage``: ``alpha = bsz /
    count_nonzero(scores).clamp(min=1)``, which overrides its ``alpha`` argument). GPG's own loss is the plain
    policy gradient ``-A logp`` (verl's ``loss_mode=gpg``); cohort's clipped losses have the same gradient
    on-policy (ratio 1, nothing clipped).
    """

    name: ClassVar[str] = "gpg"

    f_norm: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.f_norm) and self.f_norm > 0):
            raise ValueError(f"gpg f_norm={self.f_norm}: use a positive number (verl's default 1.0).")

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        return torch.nanmean(grouped, dim=1, keepdim=True)

    def advantages(self, rewards: torch.Tensor, group_size: int, *, scale_rewards: str,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] rewards -> ([N] ``alpha (r - mean_g) / f_norm``, [N] group std)."""
        grouped = rewards.view(-1, group_size)
        valid = ~torch.isnan(rewards)
        scorable = valid.sum().to(rewards.dtype)
        nonzero = (valid & (rewards != 0)).sum().clamp(min=1).to(rewards.dtype)
        centred = (grouped - self.baseline(grouped)).reshape(-1)
        return (scorable / nonzero) * centred / self.f_norm, group_std_rows(rewards, group_size)

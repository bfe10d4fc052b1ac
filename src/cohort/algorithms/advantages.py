"""Group-relative advantages from per-sample rewards.

Rewards arrive as ``[N]`` or ``[N, F]`` (F reward functions) with ``N = num_prompts * G`` and the G
completions of one prompt contiguous. A NaN means "this reward function returned None for this row"; a row
where every function returned None is *unscorable*: it gets advantage 0 and does not enter its group's mean
or standard deviation (same rule as TRL 1.16 ``GRPOTrainer._generate_and_score_completions``).

The estimator (the group baseline and its scaling) comes from the table of `cohort.algorithms.estimators`,
by name or by import path. Everything here is a pure function of tensors; the trainer only logs the fields
of `AdvantageResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from .estimators import AdvantageEstimator, build_advantage_estimator, nanstd

ScaleRewards = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"]
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]

_SCALES = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@dataclass
class AdvantageResult:
    """What `compute_advantages` returns.

    advantages: [N] the per-sample advantage (0 for unscorable rows, never NaN).
    rewards: [N] the combined per-sample reward: weighted ``nansum`` over reward functions for
        ``sum_then_normalize``, the weighted sum of per-function group-normalised rewards for
        ``normalize_then_sum``; NaN for unscorable rows.
    group_mean, group_std: [num_prompts] mean and Bessel std of ``rewards`` within each group, NaN rows left
        out (std is NaN for a group with fewer than 2 scorable rows). ``group_std`` is TRL's ``reward_std``
        per group.
    is_std_zero: [N] bool, True where the std that scaled (or, for ``none``, would have scaled) the row is 0:
        TRL's mask behind ``frac_reward_zero_std``.
    """

    advantages: torch.Tensor
    rewards: torch.Tensor
    group_mean: torch.Tensor
    group_std: torch.Tensor
    is_std_zero: torch.Tensor

    @property
    def frac_reward_zero_std(self) -> float:
        """Fraction of rows whose scaling std is zero (TRL's ``frac_reward_zero_std``)."""
        return self.is_std_zero.float().mean().item()


def _check_args(rewards: torch.Tensor, num_generations: int, scale_rewards: str,
                estimator: str | AdvantageEstimator, aggregation: str) -> AdvantageEstimator:
    """Raise ValueError for a bad argument; the estimator the name (or import path) picks otherwise."""
    if num_generations is None or int(num_generations) < 2:
        raise ValueError(
            f"num_generations={num_generations}: group-relative advantages need at least 2 completions per "
            "prompt (with 1 the group baseline equals the reward and every advantage is 0). "
            "Fix: set num_generations >= 2 (GRPO papers use 4 to 64)."
        )
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected [N] or [N, num_reward_funcs].")
    if rewards.shape[0] % num_generations != 0:
        raise ValueError(
            f"rewards has {rewards.shape[0]} rows, not a multiple of num_generations={num_generations}; "
            "groups must be contiguous blocks of num_generations completions of one prompt."
        )
    _check_choice("scale_rewards", scale_rewards, _SCALES)
    built = build_advantage_estimator(estimator)
    _check_choice("multi_objective_aggregation", aggregation, _AGGREGATIONS)
    reason = built.no_normalize_then_sum
    if aggregation == "normalize_then_sum" and reason is not None:
        name = built.name if isinstance(estimator, AdvantageEstimator) else estimator
        raise ValueError(
            f"estimator={name!r} with multi_objective_aggregation='normalize_then_sum' is not defined ({reason}). "
            f"Fix: use multi_objective_aggregation='sum_then_normalize' with {name}."
        )
    return built


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not supported; choose one of {', '.join(allowed)}.")


def _weights(rewards: torch.Tensor, reward_weights: Sequence[float] | torch.Tensor | None) -> torch.Tensor:
    num_funcs = rewards.shape[1]
    if reward_weights is None:
        return torch.ones(num_funcs, dtype=rewards.dtype, device=rewards.device)
    w = torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device).reshape(-1)
    if w.numel() != num_funcs:
        raise ValueError(
            f"reward_weights has {w.numel()} entries but there are {num_funcs} reward functions; "
            "give one weight per reward function (or None for all 1.0)."
        )
    return w


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: ScaleRewards = "group",
    estimator: Estimator | str | AdvantageEstimator = "grpo",
    reward_weights: Sequence[float] | torch.Tensor | None = None,
    multi_objective_aggregation: Aggregation = "sum_then_normalize",
    eps: float = 1e-4,
    lengths: Sequence[int] | torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
) -> AdvantageResult:
    """Group-relative advantages (GRPO, DeepSeekMath, arXiv:2402.03300) and variants.

    With ``r`` the combined reward of a row, ``mean_g`` / ``std_g`` the NaN-ignoring mean and Bessel std of
    its group ``g`` (G rows), ``std_B`` the Bessel std over the whole batch:

    - ``estimator`` picks the baseline ``b`` from `cohort.algorithms.ESTIMATORS` (or ``"pkg.module:Class"``,
      an `AdvantageEstimator`): ``"grpo"`` ``b = mean_g``; ``"rloo"`` (REINFORCE leave-one-out,
      arXiv:2402.14740) ``b = (sum_{j != i} r_j) / (n_g - 1)`` over the scorable rows of the group.
    - ``A = r - b``, then divided by ``std_g + eps`` (``scale_rewards="group"``), ``std_B + eps``
      (``"batch"``, PPO-Lite, arXiv:2508.08221) or not at all (``"none"``, Dr. GRPO, arXiv:2503.20783).
    - ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``, ``remax``, ``opo`` and ``gpg`` own their
      scaling and ignore ``scale_rewards`` (`cohort.algorithms.baselines`).

    Multiple reward functions (``rewards`` of shape [N, F], weights ``w``):

    - ``"sum_then_normalize"`` (default): ``r = nansum_f w_f r_f`` then the above.
    - ``"normalize_then_sum"`` (GDPO, arXiv:2601.05242): ``r = nansum_f w_f (r_f - mean_g,f) / (std_g,f + eps)``,
      then ``A = (r - mean_B) / (std_B + eps)`` over the batch (``scale_rewards`` is not used, as in TRL).

    Estimators that need more than the rewards (`AdvantageEstimator.needs_lengths`,
    ``needs_greedy_baseline``) get ``lengths`` ([N] trained tokens per completion: opo, reinforce_plus_plus)
    and ``baseline_rewards`` ([P] or [P, F], one greedy completion's rewards per prompt, combined with the same
    weights: remax); the others ignore both.

    Rows whose every function is NaN get ``A = 0`` and are left out of every mean and std. A group whose
    rewards are all equal has ``std = 0`` and so ``A = 0 / eps = 0`` (no NaN).

    Pass whole groups (gather rewards across ranks first): the statistics are per group, and ``batch`` /
    ``normalize_then_sum`` use the whole tensor. ``scale_rewards`` also accepts TRL's booleans (True = group,
    False = none).

    Raises ValueError for ``num_generations < 2``, a row count not a multiple of it, or unknown options.
    """
    # TRL also accepts booleans: True is "group", False is "none".
    if isinstance(scale_rewards, bool):
        scale_rewards = "group" if scale_rewards else "none"
    built = _check_args(rewards, num_generations, scale_rewards, estimator, multi_objective_aggregation)
    per_func = rewards.unsqueeze(1) if rewards.dim() == 1 else rewards
    per_func = per_func.to(torch.promote_types(per_func.dtype, torch.float32))
    weights = _weights(per_func, reward_weights)
    G = int(num_generations)
    if multi_objective_aggregation == "normalize_then_sum":
        combined, advantages, scaling_std = _normalize_then_sum(per_func, weights, G, eps)
    else:
        combined = _combine(per_func, weights)
        extras = _estimator_inputs(built, combined, G, lengths, baseline_rewards, weights)
        advantages, scaling_std = built.advantages(combined, G, scale_rewards=scale_rewards, eps=eps, **extras)
    return _result(combined, advantages, scaling_std, G)


def _combine(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, F] -> [N]: the weighted nansum, NaN where every function is NaN (an unscorable row)."""
    combined = (per_func * weights).nansum(dim=1)
    combined[torch.isnan(per_func).all(dim=1)] = torch.nan
    return combined


def _estimator_inputs(built: AdvantageEstimator, combined: torch.Tensor, group_size: int,
                      lengths: Sequence[int] | torch.Tensor | None, baseline_rewards: torch.Tensor | None,
                      weights: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The keyword arguments beyond the rewards that `built` declares it needs (none for grpo and rloo)."""
    extras: dict[str, torch.Tensor | None] = {}
    if getattr(built, "needs_lengths", False):
        extras["lengths"] = None
        if lengths is not None:
            lens = torch.as_tensor(lengths, dtype=combined.dtype, device=combined.device).reshape(-1)
            if lens.numel() != combined.numel():
                raise ValueError(f"lengths has {lens.numel()} entries for {combined.numel()} rewards; give one "
                                 "token count per completion.")
            extras["lengths"] = lens
    if getattr(built, "needs_greedy_baseline", False):
        extras["baseline_rewards"] = None
        if baseline_rewards is not None:
            base = baseline_rewards.to(combined.dtype)
            base = base.unsqueeze(1) if base.dim() == 1 else base
            if base.shape != (combined.numel() // group_size, weights.numel()):
                raise ValueError(f"baseline_rewards has shape {tuple(baseline_rewards.shape)}; expected one row "
                                 f"per prompt ({combined.numel() // group_size}) and one column per reward "
                                 f"function ({weights.numel()}).")
            extras["baseline_rewards"] = _combine(base, weights)
    return extras


def _result(combined: torch.Tensor, advantages: torch.Tensor, scaling_std: torch.Tensor,
            group_size: int) -> AdvantageResult:
    grouped = combined.view(-1, group_size)
    return AdvantageResult(
        # NaN comes only from unscorable rows or single-scorable-row groups: both carry no signal.
        advantages=torch.nan_to_num(advantages, nan=0.0),
        rewards=combined,
        group_mean=torch.nanmean(grouped, dim=1),
        group_std=nanstd(grouped, dim=1),
        is_std_zero=torch.isclose(scaling_std, torch.zeros_like(scaling_std)),
    )


def _normalize_then_sum(per_func: torch.Tensor, weights: torch.Tensor, group_size: int,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDPO: per-function group normalisation, weighted sum, then batch normalisation.

    [N, F] rewards -> ([N] combined reward, NaN for unscorable rows; [N] advantages; [N] batch std).
    """
    grouped = per_func.view(-1, group_size, per_func.shape[1])
    normed = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + eps)
    combined = (normed.reshape(per_func.shape) * weights).nansum(dim=1)
    combined[torch.isnan(per_func).all(dim=1)] = torch.nan
    batch_std = nanstd(combined).expand_as(combined)
    advantages = (combined - torch.nanmean(combined)) / (batch_std + eps)
    return combined, advantages, batch_std

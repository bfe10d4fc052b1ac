"""Group-relative advantages from per-sample rewards.

Rewards arrive as ``[N]`` or ``[N, F]`` (F reward functions) with ``N = num_prompts * G`` and the G
completions of one prompt contiguous. A NaN means "this reward function returned None for this row"; a row
where every function returned None is *unscorable*: it gets advantage 0 and does not enter its group's mean
or standard deviation (same rule as TRL 1.16 ``GRPOTrainer._generate_and_score_completions``).

Everything here is a pure function of tensors; the trainer only logs the fields of `AdvantageResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]
Estimator = Literal["grpo", "rloo"]
Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]

_SCALES = ("group", "batch", "none")
_ESTIMATORS = ("grpo", "rloo")
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


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Standard deviation with Bessel's correction, NaN entries ignored.

    ``std = sqrt( sum_valid (x - mean)^2 / (n_valid - 1) )``; NaN when fewer than 2 valid entries.
    """
    if dim is None:
        x, dim = x.reshape(-1), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    sq = torch.nansum((x - mean) ** 2, dim=dim, keepdim=keepdim)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=keepdim).to(x.dtype)
    # Fewer than 2 valid entries: NaN, so the caller maps the advantage to 0 (no signal in such a group).
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.full_like(sq, torch.nan))
    return torch.sqrt(var)


def _check_args(rewards: torch.Tensor, num_generations: int, scale_rewards: str, estimator: str,
                aggregation: str) -> None:
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
    for field, value, allowed in (("scale_rewards", scale_rewards, _SCALES), ("estimator", estimator, _ESTIMATORS),
                                  ("multi_objective_aggregation", aggregation, _AGGREGATIONS)):
        if value not in allowed:
            raise ValueError(f"{field}={value!r} is not supported; choose one of {', '.join(allowed)}.")
    if estimator == "rloo" and aggregation == "normalize_then_sum":
        raise ValueError(
            "estimator='rloo' with multi_objective_aggregation='normalize_then_sum' is not defined (the final "
            "normalisation of normalize_then_sum is over the batch, not leave-one-out). "
            "Fix: use multi_objective_aggregation='sum_then_normalize' with rloo."
        )


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


def _leave_one_out_baseline(grouped: torch.Tensor) -> torch.Tensor:
    """[P, G] -> [P, G] mean of the *other* scorable rows of the group (NaN if there are none)."""
    valid = ~torch.isnan(grouped)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    count = valid.sum(dim=1, keepdim=True).to(grouped.dtype)
    return (total - grouped) / (count - 1)


def compute_advantages(
    rewards: torch.Tensor,
    num_generations: int,
    *,
    scale_rewards: ScaleRewards = "group",
    estimator: Estimator = "grpo",
    reward_weights: Sequence[float] | torch.Tensor | None = None,
    multi_objective_aggregation: Aggregation = "sum_then_normalize",
    eps: float = 1e-4,
) -> AdvantageResult:
    """Group-relative advantages (GRPO, DeepSeekMath, arXiv:2402.03300) and variants.

    With ``r`` the combined reward of a row, ``mean_g`` / ``std_g`` the NaN-ignoring mean and Bessel std of
    its group ``g`` (G rows), ``std_B`` the Bessel std over the whole batch:

    - ``estimator="grpo"``: ``A = r - mean_g``, then divided by ``std_g + eps`` (``scale_rewards="group"``),
      ``std_B + eps`` (``"batch"``, PPO-Lite, arXiv:2508.08221) or not at all (``"none"``, Dr. GRPO,
      arXiv:2503.20783).
    - ``estimator="rloo"`` (REINFORCE leave-one-out, Ahmadian et al., arXiv:2402.14740):
      ``A = r - (sum_{j != i} r_j) / (n_g - 1)`` over the scorable rows of the group, i.e.
      ``n_g / (n_g - 1) * (r - mean_g)``; then scaled like grpo.

    Multiple reward functions (``rewards`` of shape [N, F], weights ``w``):

    - ``"sum_then_normalize"`` (default): ``r = nansum_f w_f r_f`` then the above.
    - ``"normalize_then_sum"`` (GDPO, arXiv:2601.05242): ``r = nansum_f w_f (r_f - mean_g,f) / (std_g,f + eps)``,
      then ``A = (r - mean_B) / (std_B + eps)`` over the batch (``scale_rewards`` is not used, as in TRL).

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
    _check_args(rewards, num_generations, scale_rewards, estimator, multi_objective_aggregation)
    per_func = rewards.unsqueeze(1) if rewards.dim() == 1 else rewards
    per_func = per_func.to(torch.promote_types(per_func.dtype, torch.float32))
    weights = _weights(per_func, reward_weights)
    unscorable = torch.isnan(per_func).all(dim=1)
    G = int(num_generations)

    if multi_objective_aggregation == "normalize_then_sum":
        grouped = per_func.view(-1, G, per_func.shape[1])
        normed = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + eps)
        combined = (normed.reshape(per_func.shape) * weights).nansum(dim=1)
        combined[unscorable] = torch.nan
        batch_std = nanstd(combined).expand_as(combined)
        advantages = (combined - torch.nanmean(combined)) / (batch_std + eps)
        scaling_std = batch_std
    else:
        combined = (per_func * weights).nansum(dim=1)
        combined[unscorable] = torch.nan
        grouped = combined.view(-1, G)
        if estimator == "rloo":
            centred = grouped - _leave_one_out_baseline(grouped)
        else:
            centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
        advantages = centred.reshape(-1)
        group_std_rows = nanstd(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)
        scaling_std = nanstd(combined).expand_as(combined) if scale_rewards == "batch" else group_std_rows
        if scale_rewards != "none":
            advantages = advantages / (scaling_std + eps)

    grouped = combined.view(-1, G)
    return AdvantageResult(
        # NaN comes only from unscorable rows or single-scorable-row groups: both carry no signal.
        advantages=torch.nan_to_num(advantages, nan=0.0),
        rewards=combined,
        group_mean=torch.nanmean(grouped, dim=1),
        group_std=nanstd(grouped, dim=1),
        is_std_zero=torch.isclose(scaling_std, torch.zeros_like(scaling_std)),
    )

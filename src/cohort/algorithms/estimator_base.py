"""The base of every advantage estimator, and the NaN-aware statistics the estimators share.

`AdvantageEstimator` is what the table of `cohort.algorithms.estimators` holds: a group baseline (the one
method most estimators define) and the shared ``scale_rewards`` scaling. An estimator that needs more than
the rewards says so with a class attribute, and `compute_advantages` then passes it:

- ``needs_lengths``: ``lengths=[N]``, each completion's trained tokens (OPO's weights, REINFORCE++'s
  token-level whitening); the rollout counts them.
- ``needs_greedy_baseline``: ``baseline_rewards=[P]``, the combined reward of one greedy completion per
  prompt (ReMax); the rollout generates and scores it (and never trains on it).

Both are passed only to estimators that declare them, so an ``advantages`` override written against the
plain signature keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


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


def weighted_whiten(values: torch.Tensor, weights: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``(x - mean_w) / sqrt(var_w + eps)`` over the whole tensor, NaN entries left out (and left NaN).

    ``mean_w = sum w x / sum w`` and ``var_w = sum w (x - mean_w)^2 / (sum w - 1)``: with ``w`` each row's
    token count this is verl's ``masked_whiten`` of a row value repeated over its tokens (mask sum ``sum w``,
    Bessel-corrected); with ``w = 1`` (``weights=None``) it whitens over the rows. NaN everywhere when
    ``sum w <= 1`` (no spread can be measured: the caller maps it to advantage 0).
    """
    valid = ~torch.isnan(values)
    w = torch.ones_like(values) if weights is None else weights.to(values.dtype)
    w = torch.where(valid, w, torch.zeros_like(w))
    x = torch.where(valid, values, torch.zeros_like(values))
    total = w.sum()
    mean = (w * x).sum() / total.clamp(min=1e-30)
    var = (w * (x - mean) ** 2).sum() / (total - 1).clamp(min=1e-30)
    out = (values - mean) * torch.rsqrt(var + eps)
    return out if bool(total > 1) else torch.full_like(values, torch.nan)


def group_std_rows(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] each row's group std (Bessel, NaN ignored): the zero-std mask of estimators without std scaling."""
    grouped = rewards.view(-1, group_size)
    return nanstd(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)


@dataclass
class AdvantageEstimator:
    """Base of every estimator: a group baseline (the one method a variant defines) and the shared scaling.

    no_normalize_then_sum: why the estimator has no ``multi_objective_aggregation="normalize_then_sum"``
        form (GDPO normalises each function by its group mean and std, then the sum over the batch), or None
        where that form is the estimator's own (grpo). `compute_advantages` raises with this reason.
    needs_lengths / needs_greedy_baseline: see the module docstring; an estimator that sets one receives
        ``lengths`` / ``baseline_rewards`` in `advantages`.
    """

    name: ClassVar[str] = "advantage_estimator"
    no_normalize_then_sum: ClassVar[str | None] = (
        "normalize_then_sum normalises each reward function by its group mean and std, then the sum over the "
        "batch; it does not use an estimator's baseline")
    needs_lengths: ClassVar[bool] = False
    needs_greedy_baseline: ClassVar[bool] = False

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        """[P, G] rewards (NaN = unscorable) -> the baseline each row is centred on, [P, G] or [P, 1]."""
        raise NotImplementedError

    def advantages(self, rewards: torch.Tensor, group_size: int, *, scale_rewards: str,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] combined rewards, groups of ``group_size`` contiguous -> ([N] advantages, [N] scaling std).

        ``A = (r - baseline) / (std + eps)`` with std the row's group std (``"group"``) or the batch std
        (``"batch"``); ``A = r - baseline`` for ``"none"`` (the scaling std is still returned: it is TRL's
        zero-std mask). NaN advantages are allowed: the caller maps them to 0.
        """
        grouped = rewards.view(-1, group_size)
        advantages = (grouped - self.baseline(grouped)).reshape(-1)
        scaling_std = nanstd(rewards).expand_as(rewards) if scale_rewards == "batch" else group_std_rows(
            rewards, group_size)
        if scale_rewards != "none":
            advantages = advantages / (scaling_std + eps)
        return advantages, scaling_std

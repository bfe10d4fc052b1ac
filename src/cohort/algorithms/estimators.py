"""The one table of advantage estimators, and how to build one from a name or an import path.

An estimator turns the combined per-sample rewards of whole groups into advantages; `compute_advantages`
(`cohort.algorithms.advantages`) combines the reward functions, picks the estimator here and finishes up
(NaN -> 0, the logged group statistics). With ``mean_g`` / ``std_g`` the NaN-ignoring mean and Bessel std of
a row's group, ``n_g`` its count of scorable rows:

========  ================  ==========================================  ============================
name      class             baseline ``b``, then ``A = (r - b) / s``    paper
========  ================  ==========================================  ============================
``grpo``  GRPOEstimator     ``mean_g``                                  arXiv:2402.03300
``rloo``  RLOOEstimator     ``(sum_{j != i} r_j) / (n_g - 1)``          arXiv:2402.14740
========  ================  ==========================================  ============================

``s`` is set by ``scale_rewards`` for every estimator that keeps the base `AdvantageEstimator.advantages`:
``std_g + eps`` (group), ``std_batch + eps`` (batch) or 1 (none).

User code plugs in by import path, ``"my_pkg.estimators:MyEstimator"`` (config ``advantage.estimator``),
naming a subclass of `AdvantageEstimator` (or a zero-argument factory returning one) that overrides
`AdvantageEstimator.baseline`, or `AdvantageEstimator.advantages` for a different scaling too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cohort.errors import ConfigError
from cohort.resolve import is_import_path, resolve_object


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


@dataclass
class AdvantageEstimator:
    """Base of every estimator: a group baseline (the one method a variant defines) and the shared scaling.

    no_normalize_then_sum: why the estimator has no ``multi_objective_aggregation="normalize_then_sum"``
        form (GDPO normalises each function by its group mean and std, then the sum over the batch), or None
        where that form is the estimator's own (grpo). `compute_advantages` raises with this reason.
    """

    name: ClassVar[str] = "advantage_estimator"
    no_normalize_then_sum: ClassVar[str | None] = (
        "normalize_then_sum normalises each reward function by its group mean and std, then the sum over the "
        "batch; it does not use an estimator's baseline")

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
        group_std_rows = nanstd(grouped, dim=1, keepdim=True).expand_as(grouped).reshape(-1)
        scaling_std = nanstd(rewards).expand_as(rewards) if scale_rewards == "batch" else group_std_rows
        if scale_rewards != "none":
            advantages = advantages / (scaling_std + eps)
        return advantages, scaling_std


@dataclass
class GRPOEstimator(AdvantageEstimator):
    """GRPO (DeepSeekMath, arXiv:2402.03300): the group mean, ``b = mean_g``."""

    name: ClassVar[str] = "grpo"
    no_normalize_then_sum: ClassVar[str | None] = None

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        return torch.nanmean(grouped, dim=1, keepdim=True)


@dataclass
class RLOOEstimator(AdvantageEstimator):
    """REINFORCE leave-one-out (Ahmadian et al., arXiv:2402.14740): the mean of the *other* scorable rows,
    ``b_i = (sum_{j != i} r_j) / (n_g - 1)``, so ``r - b = n_g / (n_g - 1) * (r - mean_g)``; NaN where the
    row is the group's only scorable one."""

    name: ClassVar[str] = "rloo"
    no_normalize_then_sum: ClassVar[str | None] = (
        "the final normalisation of normalize_then_sum is over the batch, not leave-one-out")

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        valid = ~torch.isnan(grouped)
        total = torch.nansum(grouped, dim=1, keepdim=True)
        count = valid.sum(dim=1, keepdim=True).to(grouped.dtype)
        return (total - grouped) / (count - 1)


DEFAULT_ESTIMATOR = "grpo"

ESTIMATORS: dict[str, type[AdvantageEstimator]] = {
    "grpo": GRPOEstimator,
    "rloo": RLOOEstimator,
}


def list_advantage_estimators() -> list[str]:
    """Every registered estimator name."""
    return list(ESTIMATORS)


def build_advantage_estimator(name_or_path: str | AdvantageEstimator = DEFAULT_ESTIMATOR) -> AdvantageEstimator:
    """The estimator called ``name_or_path``: a name of `ESTIMATORS`, or ``"pkg.module:Class"`` naming an
    `AdvantageEstimator` subclass (or a zero-argument factory returning one). An estimator instance is
    returned as it is.

    Raises ConfigError (a ValueError) for an unknown name ("did you mean", the choices) or a path that
    cannot be imported (`cohort.resolve.resolve_object`), TypeError if the path builds no estimator.
    """
    if isinstance(name_or_path, AdvantageEstimator):
        return name_or_path
    if name_or_path in ESTIMATORS:
        return ESTIMATORS[name_or_path]()
    if is_import_path(name_or_path):
        factory = resolve_object(name_or_path, field="estimator import path", expects="EstimatorClass")
        estimator = factory() if callable(factory) else factory
        if not callable(getattr(estimator, "advantages", None)):
            raise TypeError(f"estimator={name_or_path!r} built a {type(estimator).__name__}, not an advantage "
                            "estimator; point it at a subclass of cohort.algorithms.AdvantageEstimator.")
        return estimator
    raise _unknown(name_or_path)


def _unknown(value: Any) -> ConfigError:
    close = difflib.get_close_matches(str(value), list(ESTIMATORS), n=3, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ConfigError(f"estimator={value!r} is not supported.{hint} Choose one of {', '.join(ESTIMATORS)}, or "
                       "an import path 'package.module:EstimatorClass' (a subclass of AdvantageEstimator).")

"""The one table of advantage estimators, and how to build one from a name or an import path.

An estimator turns the combined per-sample rewards of whole groups into advantages; `compute_advantages`
(`cohort.algorithms.advantages`) combines the reward functions, picks the estimator here and finishes up
(NaN -> 0, the logged group statistics). With ``mean_g`` / ``std_g`` the NaN-ignoring mean and Bessel std of
a row's group, ``n_g`` its count of scorable rows:

================================  ===============================  ============================================
name                              class                            advantage ``A``
================================  ===============================  ============================================
``grpo``                          GRPOEstimator                    ``(r - mean_g) / s``  (arXiv:2402.03300)
``rloo``                          RLOOEstimator                    ``(r - sum_{j != i} r_j / (n_g - 1)) / s``
``reinforce_plus_plus``           ReinforcePlusPlusEstimator       ``whiten_B(r)``  (arXiv:2501.03262)
``reinforce_plus_plus_baseline``  ReinforcePlusPlusBaseline...     ``whiten_B(r - mean_g)``
``remax``                         ReMaxEstimator                   ``r - r_greedy``  (arXiv:2310.10505)
``opo``                           OPOEstimator                     ``r - sum_g(len r) / sum_g(len)``
``gpg``                           GPGEstimator                     ``alpha (r - mean_g) / f_norm``
================================  ===============================  ============================================

``s`` is set by ``scale_rewards`` for every estimator that keeps the base `AdvantageEstimator.advantages`
(grpo, rloo): ``std_g + eps`` (group), ``std_batch + eps`` (batch) or 1 (none). The others own their scaling
and do not read ``scale_rewards``: `cohort.algorithms.baselines` has them and their sources (verl's
``core_algos.py``).

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

from .baselines import (
    GPGEstimator,
    OPOEstimator,
    ReinforcePlusPlusBaselineEstimator,
    ReinforcePlusPlusEstimator,
    ReMaxEstimator,
)
from .estimator_base import AdvantageEstimator, nanstd

__all__ = [
    "DEFAULT_ESTIMATOR",
    "ESTIMATORS",
    "AdvantageEstimator",
    "GPGEstimator",
    "GRPOEstimator",
    "OPOEstimator",
    "RLOOEstimator",
    "ReMaxEstimator",
    "ReinforcePlusPlusBaselineEstimator",
    "ReinforcePlusPlusEstimator",
    "build_advantage_estimator",
    "list_advantage_estimators",
    "nanstd",
]


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
    "reinforce_plus_plus": ReinforcePlusPlusEstimator,
    "reinforce_plus_plus_baseline": ReinforcePlusPlusBaselineEstimator,
    "remax": ReMaxEstimator,
    "opo": OPOEstimator,
    "gpg": GPGEstimator,
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

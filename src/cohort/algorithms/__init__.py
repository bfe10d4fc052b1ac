"""GRPO algorithm core: advantages, KL estimators and policy losses as pure PyTorch functions.

Typical trainer use::

    from cohort.algorithms import LossInputs, build_policy_loss, compute_advantages

    adv = compute_advantages(rewards, num_generations=G, scale_rewards="group")
    loss_fn = build_policy_loss("dapo", {"epsilon_high": 0.28, "beta": 0.0})
    for micro in micro_batches:                     # global counts make accumulation exact
        out = loss_fn(LossInputs(logprobs=..., mask=..., advantages=..., num_tokens=step_tokens,
                                 num_sequences=step_rows))
        out.loss.backward()
    metrics = reduce_metrics(outputs_metrics)       # see loss_io for the reduction rule

See docs/algorithms.md for every option, its paper and formula, and the TRL/verl name mapping.
"""

from .advantages import AdvantageResult, compute_advantages
from .base import PolicyLoss, RatioContext
from .corrections import (
    SAMPLER_IS_MODES,
    entropy_quantile_threshold,
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_is_weights,
)
from .estimators import (
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    AdvantageEstimator,
    GPGEstimator,
    GRPOEstimator,
    OPOEstimator,
    ReinforcePlusPlusBaselineEstimator,
    ReinforcePlusPlusEstimator,
    ReMaxEstimator,
    RLOOEstimator,
    build_advantage_estimator,
    list_advantage_estimators,
    nanstd,
)
from .eval_stats import majority_correct, pass_at_k, pass_at_k_ks, sampled_eval_metrics, wilson_interval
from .kl import KL_ESTIMATORS, kl_penalty
from .loss_io import AGGREGATIONS, LossInputs, LossOutput, aggregate, metric_reduction, reduce_metrics
from .losses import (
    DEFAULT_LOSS,
    LOSS_TABLE,
    TRL_LOSS_TYPES,
    build_policy_loss,
    get_policy_loss,
    list_policy_losses,
    policy_loss_parameters,
)
from .variants import CISPOLoss, ClippedLoss, SAPOLoss, VESPOLoss

__all__ = [
    "AGGREGATIONS",
    "DEFAULT_ESTIMATOR",
    "DEFAULT_LOSS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_TABLE",
    "SAMPLER_IS_MODES",
    "TRL_LOSS_TYPES",
    "AdvantageEstimator",
    "AdvantageResult",
    "CISPOLoss",
    "ClippedLoss",
    "GPGEstimator",
    "GRPOEstimator",
    "LossInputs",
    "LossOutput",
    "OPOEstimator",
    "PolicyLoss",
    "RLOOEstimator",
    "RatioContext",
    "ReMaxEstimator",
    "ReinforcePlusPlusBaselineEstimator",
    "ReinforcePlusPlusEstimator",
    "SAPOLoss",
    "VESPOLoss",
    "aggregate",
    "build_advantage_estimator",
    "build_policy_loss",
    "compute_advantages",
    "entropy_quantile_threshold",
    "get_policy_loss",
    "high_entropy_mask",
    "kl_penalty",
    "list_advantage_estimators",
    "list_policy_losses",
    "majority_correct",
    "metric_reduction",
    "nanstd",
    "off_policy_sequence_mask",
    "pass_at_k",
    "pass_at_k_ks",
    "policy_loss_parameters",
    "reduce_metrics",
    "sampled_eval_metrics",
    "sampler_is_weights",
    "wilson_interval",
]

"""The per-token objectives of the built-in policy losses.

Notation: ``r`` the importance ratio (token or sequence level, see `cohort.algorithms.base`), ``A`` the
advantage, ``logp`` the policy log-prob, ``sg`` stop-gradient, ``eps_l = epsilon``, ``eps_h = epsilon_high``.
Each class owns its parameters; which aggregation a *name* uses is set in `cohort.algorithms.losses`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .base import PolicyLoss, RatioContext, masked_extreme


@dataclass
class ClippedLoss(PolicyLoss):
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347) as used by GRPO (arXiv:2402.03300), DAPO
    (arXiv:2503.14476, clip-higher ``epsilon_high``), Dr. GRPO (arXiv:2503.20783), GSPO (arXiv:2507.18071,
    with ``importance_sampling_level="sequence"``) and LUSPO (arXiv:2602.05261)::

        L = -min( r' A, clip(r, 1 - eps_l, 1 + eps_h) A ),   r' = min(r, delta) if delta else r

    ``delta`` is INTELLECT-2's two-sided clip (arXiv:2505.07291, use delta > 1 + eps_h). ``clip_ratio_c``
    is verl's dual clip (Ye et al., arXiv:1912.09729) for ``A < 0``: ``L = min(L, -A * clip_ratio_c)``.
    ``epsilon_high=None`` means ``epsilon`` (symmetric clip, TRL default).

    Metrics (TRL names): clip_ratio/low_mean, clip_ratio/low_min, clip_ratio/high_mean, clip_ratio/high_max,
    clip_ratio/region_mean (``r' < 1-eps_l`` with ``A<0``; ``r' > 1+eps_h`` with ``A>0``), plus
    clip_ratio/dual_mean when ``clip_ratio_c`` is set.
    """

    name = "clipped"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    clip_ratio_c: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (verl default 3.0), or None to disable.")

    def objective(self, ctx: RatioContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio, adv = ctx.ratio, ctx.advantages
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high  # set in __post_init__
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + eps_high)
        if self.delta is not None:
            ratio = torch.clamp(ratio, max=self.delta)
        per_token = -torch.min(ratio * adv, clipped * adv)
        metrics = {}
        if self.clip_ratio_c is not None:
            bound = -adv * self.clip_ratio_c
            dual = (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.min(per_token, bound), per_token)
            metrics["clip_ratio/dual_mean"] = self._mean(dual.to(ratio.dtype), ctx)
        low = ((ratio < 1 - self.epsilon) & (adv < 0)).to(ratio.dtype)
        high = ((ratio > 1 + eps_high) & (adv > 0)).to(ratio.dtype)
        metrics.update({
            "clip_ratio/low_mean": self._mean(low, ctx),
            "clip_ratio/high_mean": self._mean(high, ctx),
            "clip_ratio/region_mean": self._mean(torch.max(low, high), ctx),
            "clip_ratio/low_min": _nan_extreme(self._seq_means(low, ctx), torch.amin),
            "clip_ratio/high_max": _nan_extreme(self._seq_means(high, ctx), torch.amax),
        })
        return per_token, metrics


@dataclass
class CISPOLoss(PolicyLoss):
    """CISPO (MiniMax-M1, arXiv:2506.13585; ScaleRL, arXiv:2510.13786): clip the importance *weight*, keep
    every token's gradient::

        L = -sg( min(r, eps_max) ) * A * logp,     grad = -min(r, eps_max) * A * grad logp

    ``epsilon_high`` here is the absolute cap ``eps_max`` on the ratio (ScaleRL, TRL), not ``1 + eps``.
    TRL pitfall: its ``epsilon_high`` defaults to ``epsilon`` (0.2) when unset, which under cispo caps every
    weight at 0.2 and silently shrinks all updates five-fold. Our default is ScaleRL's recommended
    ``epsilon_high = 5.0``. A value below 1 can only be a clip *range* (what ``epsilon_high`` means for every
    other loss, and for CISPO in MiniMax-M1 and verl: ``eps_max = 1 + epsilon_high``), e.g. a DAPO recipe's
    0.28 kept when only ``loss.loss_type`` is switched to cispo: it is read so, with a warning, never as a
    cap that would down-weight on-policy tokens.

    Metric: cispo_clip_ratio (fraction of loss tokens with ``r > eps_max`` and ``A > 0``, as TRL).
    """

    name = "cispo"
    epsilon_high: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.epsilon_high is None:
            self.epsilon_high = 5.0
        if self.epsilon_high < 0.0:
            raise ValueError(f"epsilon_high={self.epsilon_high} under cispo must be >= 0: the cap eps_max (>= 1) on "
                             "the importance ratio, or a clip range below 1 (eps_max = 1 + epsilon_high). ScaleRL "
                             "(arXiv:2510.13786) recommends eps_max = 5.0, our default.")
        if self.epsilon_high < 1.0:
            cap = 1.0 + self.epsilon_high
            warnings.warn(f"loss.epsilon_high={self.epsilon_high} under cispo: a cap below 1 would down-weight even "
                          f"on-policy tokens, so it is read as a clip range (MiniMax-M1, verl): eps_max = 1 + "
                          f"{self.epsilon_high} = {cap:g}. Set loss.epsilon_high to the cap itself (>= 1; ScaleRL "
                          "recommends 5.0) to silence this.", stacklevel=2)
            self.epsilon_high = cap

    def objective(self, ctx: RatioContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weight = torch.clamp(ctx.ratio, max=self.epsilon_high).detach()
        per_token = -weight * ctx.advantages * ctx.inputs.logprobs
        clipped = ((ctx.ratio > self.epsilon_high) & (ctx.advantages > 0)).to(ctx.ratio.dtype)
        return per_token, {"cispo_clip_ratio": self._mean(clipped, ctx)}


@dataclass
class SAPOLoss(PolicyLoss):
    """SAPO, soft adaptive policy optimisation (arXiv:2511.20347): a smooth gate instead of a hard clip::

        L = -(4 / tau) * sigmoid(tau * (r - 1)) * A,   tau = tau_pos if A > 0 else tau_neg

    At ``r = 1`` the gate's value is ``2 / tau`` and its derivative in ``r`` is ``4/tau * tau * 1/4 = 1``, so
    on-policy the gradient is the plain policy gradient ``-A grad logp``; far off-policy it fades smoothly.
    Defaults tau_pos = 1.0, tau_neg = 1.05 (TRL, paper).
    """

    name = "sapo"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05

    def objective(self, ctx: RatioContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        adv = ctx.advantages
        tau = torch.where(adv > 0, self.sapo_temperature_pos, self.sapo_temperature_neg).to(ctx.ratio.dtype)
        gate = torch.sigmoid(tau * (ctx.ratio - 1)) * 4 / tau
        return -gate * adv, {}


@dataclass
class VESPOLoss(PolicyLoss):
    """VESPO (arXiv:2602.10693): a detached Gamma-shaped weight of the *sequence* importance ratio::

        log w = clamp( sum_t clamp(logp - logp_old, -20, 20) m + sum_t log(clamp(w_is)), log 1e-8, 20 )
        phi(w) = exp( lam + k log w - lam w )      (phi(1) = 1; k, lam by the sign of A)
        L = -sg(phi) * A * logp

    ``k, lam = (vespo_k_pos, vespo_lambda_pos)`` for ``A >= 0`` else ``(vespo_k_neg, vespo_lambda_neg)``.
    The sampler IS weights (token modes only) enter ``w`` instead of multiplying the loss; so vespo's default
    ``sampler_is_mode`` is ``token_truncate`` (TRL's global default, ``sequence_mask``, is an error with vespo).
    Metric: vespo/phi_seq_mean.
    """

    name = "vespo"
    _multiplies_sampler_weights = False
    sampler_is_mode: str = "token_truncate"
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sampler_is_correction and not self.sampler_is_mode.startswith("token"):
            raise ValueError(
                f"vespo needs token-level sampler weights but sampler_is_mode={self.sampler_is_mode!r}. "
                "Fix: set sampler_is_mode to 'token_truncate' or 'token_mask' (or sampler_is_correction=False)."
            )

    def objective(self, ctx: RatioContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        phi = self.gamma_weights(ctx)
        per_token = -phi * ctx.advantages * ctx.inputs.logprobs
        return per_token, {"vespo/phi_seq_mean": self._mean(phi, ctx)}

    @torch.no_grad()
    def gamma_weights(self, ctx: RatioContext) -> torch.Tensor:
        """[B, 1] detached ``phi(w)`` (computed in log space)."""
        floor = math.log(1e-8)
        seq_log_w = (torch.clamp(ctx.log_ratio, -20.0, 20.0) * ctx.mask).sum(-1, keepdim=True)
        if ctx.sampler_weights is not None:
            seq_log_w = seq_log_w + torch.clamp(torch.log(ctx.sampler_weights), floor, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(seq_log_w, floor, 20.0)
        nonneg = ctx.advantages >= 0
        k = torch.where(nonneg, self.vespo_k_pos, self.vespo_k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, self.vespo_lambda_pos, self.vespo_lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _nan_extreme(values: torch.Tensor, op) -> torch.Tensor:
    """min/max (op: torch.amin / torch.amax) over the non-NaN entries (TRL's nanmin/nanmax); NaN when none."""
    return masked_extreme(values, ~torch.isnan(values), op)

"""The shared pipeline every policy loss runs; variants only supply the per-token objective.

``PolicyLoss.__call__`` follows TRL 1.16 ``GRPOTrainer._compute_loss`` step by step:

1. ratio ``r = exp(logp - logp_old)`` per token, or per sequence (GSPO, arXiv:2507.18071):
   ``r_i = exp( sum_t (logp - logp_old) m / sum_t m )``;
2. the variant's per-token loss ``L`` (`PolicyLoss.objective`);
3. ``L *=`` off-policy sequence mask, high-entropy mask, sampler importance weights (each if enabled);
4. ``L += beta * KL`` (``KL * r`` when ``use_bias_correction_kl``, DeepSeek-V3.2 arXiv:2512.02556);
5. aggregate with global counts (`cohort.algorithms.loss_io.aggregate`);
6. ``loss -= entropy_coef * sum_t H m_e / count`` (entropy bonus over the tokens the loss acts on).

Deliberate difference from TRL: the normalisers are the *global* counts of the optimizer step (passed in
`LossInputs`), so every loss type accumulates exactly; TRL divides ``grpo``/``bnpo``/``dr_grpo``/``luspo``
per micro-batch by ``gradient_accumulation_steps`` (equal only with equal micro-batches, and never for bnpo
when token counts differ), and ``dapo`` by the generation batch's token count rescaled to one step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .corrections import (
    SAMPLER_IS_MODES,
    entropy_quantile_threshold,
    high_entropy_mask,
    off_policy_sequence_mask,
    sampler_is_weights,
)
from .kl import KL_ESTIMATORS, kl_penalty
from .loss_io import AGGREGATIONS, Count, LossInputs, LossOutput, aggregate


@dataclass
class RatioContext:
    """What a variant's objective sees. ``advantages`` is [B, 1] (or [B, T]); ``ratio`` is [B, T] or [B, 1]."""

    inputs: LossInputs
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    sampler_weights: torch.Tensor | None
    num_tokens: Count
    num_sequences: Count


@dataclass
class PolicyLoss:
    """Base of every built-in loss: the parameters shared by all variants (TRL GRPOConfig names/defaults).

    aggregation: one of token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm.
    loss_scale_factor: the Dr. GRPO constant for seq-mean-token-sum-norm (None = max_completion_length).
    importance_sampling_level: "token" or "sequence" (GSPO, arXiv:2507.18071).
    beta, kl_estimator, use_bias_correction_kl: KL term ``beta * KL`` (see `cohort.algorithms.kl`), times the
        ratio when use_bias_correction_kl (TRL default True).
    top_entropy_quantile, entropy_coef: high-entropy token selection (arXiv:2506.01939) and entropy bonus.
    off_policy_mask_threshold: DeepSeek-V3.2 OPSM delta (None = off).
    sampler_is_correction/mode/clip_min/clip_max: train/inference mismatch weights, applied when
        `LossInputs.sampling_logprobs` is given (TRL's vllm_importance_sampling_*; defaults equal).
    """

    name: ClassVar[str] = "policy_loss"
    # Whether the sampler IS weights multiply the loss (VESPO folds them into its own weight instead).
    _multiplies_sampler_weights: ClassVar[bool] = True

    aggregation: str = "token-mean"
    loss_scale_factor: float | None = None
    importance_sampling_level: str = "token"
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = True
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None
    sampler_is_correction: bool = True
    sampler_is_mode: str = "sequence_mask"
    sampler_is_clip_min: float | None = None
    sampler_is_clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        checks = (("aggregation", self.aggregation, AGGREGATIONS),
                  ("importance_sampling_level", self.importance_sampling_level, ("token", "sequence")),
                  ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
                  ("sampler_is_mode", self.sampler_is_mode, SAMPLER_IS_MODES))
        for field_name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{field_name}={value!r} is not supported by loss {self.name!r}; choose one of "
                                 f"{', '.join(allowed)}.")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} must lie in [0, 1] (1 keeps all).")

    # -- the one thing a variant defines -------------------------------------------------------------------
    def objective(self, ctx: RatioContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss ([B, T] or [B, 1]) and the variant's own metrics (partial values, see loss_io)."""
        raise NotImplementedError

    # -- shared pipeline -----------------------------------------------------------------------------------
    def __call__(self, inputs: LossInputs) -> LossOutput:
        ctx = self._context(inputs)
        mask = ctx.mask
        per_token, metrics = self.objective(ctx)
        if self.off_policy_mask_threshold is not None:
            behaviour = inputs.sampling_logprobs if inputs.sampling_logprobs is not None else ctx.old_logprobs
            per_token = per_token * off_policy_sequence_mask(
                ctx.advantages, inputs.logprobs, behaviour, mask, self.off_policy_mask_threshold)
        entropy_mask = self._entropy_mask(inputs, mask)
        if entropy_mask is not None:
            per_token = per_token * entropy_mask
        if ctx.sampler_weights is not None and self._multiplies_sampler_weights:
            per_token = per_token * ctx.sampler_weights
        if self.beta != 0.0:
            per_token_kl = self._kl(inputs, ctx)
            per_token = per_token + self.beta * per_token_kl
            metrics["kl"] = self._mean(per_token_kl, ctx)
        loss = aggregate(per_token, mask, self.aggregation, num_tokens=ctx.num_tokens,
                         num_sequences=ctx.num_sequences,
                         loss_scale_factor=self.loss_scale_factor or inputs.max_completion_length)
        metrics["policy_loss"] = loss.detach()
        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * self._entropy_bonus(inputs, mask, entropy_mask, ctx)
        metrics["loss"] = loss.detach()  # TRL's "loss": what backward sees (KL and entropy bonus included)
        if inputs.entropy is not None:
            metrics["entropy"] = self._mean(inputs.entropy.detach(), ctx)
        if ctx.sampler_weights is not None:
            metrics.update(self._sampler_metrics(ctx))
        return LossOutput(loss=loss, metrics=metrics)

    def _context(self, inputs: LossInputs) -> RatioContext:
        logprobs = inputs.logprobs
        mask = inputs.mask.to(logprobs.dtype)
        old = logprobs.detach() if inputs.old_logprobs is None else inputs.old_logprobs
        log_ratio = logprobs - old
        if self.importance_sampling_level == "sequence":
            log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            log_w = log_ratio
        adv = inputs.advantages
        adv = (adv.unsqueeze(1) if adv.dim() == 1 else adv).to(logprobs.dtype)
        weights = None
        if inputs.sampling_logprobs is not None and self.sampler_is_correction:
            weights = sampler_is_weights(old, inputs.sampling_logprobs, mask, self.sampler_is_mode,
                                         self.sampler_is_clip_min, self.sampler_is_clip_max)
        return RatioContext(
            inputs=inputs, mask=mask, advantages=adv, old_logprobs=old, log_ratio=log_ratio,
            ratio=torch.exp(log_w), sampler_weights=weights,
            num_tokens=_at_least_one(mask.sum() if inputs.num_tokens is None else inputs.num_tokens),
            num_sequences=_at_least_one(mask.shape[0] if inputs.num_sequences is None else inputs.num_sequences),
        )

    def _entropy_mask(self, inputs: LossInputs, mask: torch.Tensor) -> torch.Tensor | None:
        if self.top_entropy_quantile >= 1.0:
            return None
        if inputs.entropy is None:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} needs LossInputs.entropy; "
                             "compute per-token entropy in the policy forward or set top_entropy_quantile=1.0.")
        threshold = inputs.entropy_threshold
        if threshold is None:
            threshold = entropy_quantile_threshold(inputs.entropy, mask, self.top_entropy_quantile)
        return high_entropy_mask(inputs.entropy, mask, threshold)

    def _kl(self, inputs: LossInputs, ctx: RatioContext) -> torch.Tensor:
        if inputs.ref_logprobs is None:
            raise ValueError(f"beta={self.beta} needs LossInputs.ref_logprobs (reference model log-probs); "
                             "pass them or set beta=0.0.")
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, self.kl_estimator)
        return kl * ctx.ratio if self.use_bias_correction_kl else kl

    def _entropy_bonus(self, inputs: LossInputs, mask: torch.Tensor, entropy_mask: torch.Tensor | None,
                       ctx: RatioContext) -> torch.Tensor:
        if inputs.entropy is None:
            raise ValueError(f"entropy_coef={self.entropy_coef} needs LossInputs.entropy (per-token entropy with "
                             "grad); pass it or set entropy_coef=0.0.")
        if entropy_mask is None:
            return (inputs.entropy * mask).sum() / ctx.num_tokens
        effective = mask * entropy_mask
        count = inputs.num_entropy_tokens
        count = effective.sum().clamp(min=1.0) if count is None else count
        return (inputs.entropy * effective).sum() / count

    @staticmethod
    def _mean(x: torch.Tensor, ctx: RatioContext) -> torch.Tensor:
        """Partial masked mean: token tensors over num_tokens, per-sequence [B, 1] tensors over num_sequences."""
        x = x.detach()
        if x.shape[-1] == 1 and ctx.mask.shape[-1] != 1:
            return x.sum() / ctx.num_sequences
        return (x * ctx.mask).sum() / ctx.num_tokens

    @staticmethod
    def _seq_means(x: torch.Tensor, ctx: RatioContext) -> torch.Tensor:
        """Per-sequence masked mean (NaN for rows with no loss token, skipped by nanmin/nanmax)."""
        x = x.detach()
        if x.shape[-1] == 1 and ctx.mask.shape[-1] != 1:
            return x.squeeze(-1)
        return (x * ctx.mask).sum(-1) / ctx.mask.sum(-1)

    def _sampler_metrics(self, ctx: RatioContext) -> dict[str, torch.Tensor]:
        w = ctx.sampler_weights
        assert w is not None  # called only when sampler weights were computed
        w = w.detach()
        # masked min / max as reductions with a fill value, NaN when no token counts: boolean indexing has a
        # data-dependent size, so it would make the host wait for the GPU in every micro-batch
        if w.shape[-1] == 1 and ctx.mask.shape[-1] != 1:
            counted = torch.ones_like(w, dtype=torch.bool)
        else:
            counted = ctx.mask.bool()
        out = {
            "sampling/importance_sampling_ratio/min": masked_extreme(w, counted, torch.amin),
            "sampling/importance_sampling_ratio/mean": self._mean(w, ctx),
            "sampling/importance_sampling_ratio/max": masked_extreme(w, counted, torch.amax),
        }
        sampling = ctx.inputs.sampling_logprobs
        if sampling is not None and sampling.shape == ctx.old_logprobs.shape == ctx.mask.shape:
            # TRL 1.16's mismatch gauge: |trainer's old logprob - sampler's logprob| over completion tokens
            delta = (ctx.old_logprobs.detach() - sampling).abs()
            out["sampling/sampling_logp_difference/mean"] = self._mean(delta, ctx)
            out["sampling/sampling_logp_difference/max"] = masked_extreme(delta, ctx.mask.bool(), torch.amax)
        return out


def _at_least_one(count):
    """A step whose every token is masked has loss 0, not 0/0 (TRL clamps its normalisers the same way)."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def masked_extreme(values: torch.Tensor, counted: torch.Tensor, op) -> torch.Tensor:
    """op (torch.amin / torch.amax) over the entries where `counted`; NaN when none counts. A reduction with a
    fill value, not boolean indexing, whose data-dependent size would make the host wait for the GPU."""
    if values.numel() == 0:
        return values.new_full((), torch.nan)
    fill = torch.inf if op is torch.amin else -torch.inf
    extreme = op(torch.where(counted, values, fill))
    return torch.where(counted.any(), extreme, torch.full_like(extreme, torch.nan))

"""Token and sequence weights/masks that multiply a per-token policy loss.

- `sampler_is_weights`: importance weights correcting the mismatch between the rollout engine's sampling
  distribution and the trainer's recomputed one (truncated IS, Yao et al. 2025 "Your efficient RL framework
  secretly brings you off-policy RL training", https://fengyao.notion.site/off-policy-rl; masked IS, Liu et
  al. 2025 "When speed kills stability", https://yingru.notion.site/When-Speed-Kills-Stability).
- `off_policy_sequence_mask`: DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556, eq. 9).
- `entropy_quantile_threshold` / `high_entropy_mask`: train on the top-rho highest-entropy tokens
  ("Beyond the 80/20 rule", arXiv:2506.01939).

All are computed without gradient: they only scale the loss.
"""

from __future__ import annotations

import math

import torch

SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@torch.no_grad()
def sampler_is_weights(
    old_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Train/inference mismatch weights ``w = pi_old / pi_sampler`` (TRL 1.16 semantics): truncated IS (TIS,
    Yao et al. 2025) for ``*_truncate``, masked IS (MIS, Liu et al. 2025) for ``*_mask``.

    ``delta_t = (old_logprobs_t - sampling_logprobs_t) * m_t`` (NaN -> 0, i.e. weight 1 for unreported tokens).
    Token modes: ``w_t = exp(delta_t)`` [B, T]. Sequence modes: ``w = exp(sum_t delta_t)`` [B, 1].
    ``*_truncate``: ``w <- clamp(w, clip_min, clip_max)`` (TIS). ``*_mask``: ``w <- 0`` where
    ``w < clip_min`` or ``w > clip_max`` (MIS); a None bound is no bound.
    """
    if mode not in SAMPLER_IS_MODES:
        raise ValueError(f"sampler_is_mode={mode!r} is not supported; choose one of {', '.join(SAMPLER_IS_MODES)}.")
    delta = torch.nan_to_num((old_logprobs - sampling_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence"):
        delta = delta.sum(dim=-1, keepdim=True)
    weights = torch.exp(delta)
    if mode.endswith("truncate"):
        return torch.clamp(weights, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


@torch.no_grad()
def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2 OPSM (arXiv:2512.02556): drop a sequence when ``A < 0`` and its mean token KL
    ``sum_t (behaviour_logp - logp) m / max(1, sum_t m)`` exceeds ``threshold``. Returns [B, 1] of 0/1."""
    kl = torch.nan_to_num(behaviour_logprobs - logprobs, nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)
    keep = (adv >= 0) | (mean_kl <= threshold)
    return keep.to(mask.dtype)


@torch.no_grad()
def entropy_quantile_threshold(entropy: torch.Tensor, mask: torch.Tensor, top_quantile: float) -> torch.Tensor:
    """The entropy value above which the top ``top_quantile`` fraction of loss tokens lies (arXiv:2506.01939):
    ``quantile(entropy[mask], 1 - top_quantile)`` (linear interpolation, as ``torch.quantile``).
    Compute it over all micro-batches of a step for exact gradient accumulation."""
    selected = entropy[mask.bool()].float()
    if selected.numel() == 0:
        return torch.tensor(math.inf, device=entropy.device)
    return torch.quantile(selected, 1.0 - top_quantile)


@torch.no_grad()
def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask of loss tokens whose entropy is ``>= threshold`` (arXiv:2506.01939)."""
    return ((entropy * mask >= threshold) & mask.bool()).to(mask.dtype)

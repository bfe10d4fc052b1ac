"""What a policy loss receives and returns, and how its pieces are reduced over a whole step.

Normalisation contract (what makes gradient accumulation exact): every loss divides by *global* counts of
the optimizer step's mini-batch, ``num_tokens`` (loss tokens summed over all micro-batches and ranks) and
``num_sequences`` (rows, likewise). So for micro-batches ``m`` of one step, ``sum_m loss_m`` is exactly
the whole-batch loss and calling ``backward()`` on each ``loss_m`` accumulates exactly the whole-batch
gradient. Left as None, the counts default to this call's own (the single-micro-batch case).

Metrics contract: ``LossOutput.metrics`` holds *partial* values, already divided by the same global
counts. Reduce them over micro-batches (and ranks) by the rule of `metric_reduction`: names ending in
``min`` with MIN, in ``max`` with MAX, all others with SUM. `reduce_metrics` does this for a list of
micro-batch outputs on one rank; across ranks all-reduce with the same ops.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

Count = int | float | torch.Tensor


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, shape [B, T] unless noted.

    logprobs: policy log-prob of each completion token, with grad.
    mask: 1 for tokens that enter the loss, 0 for padding / tool output / masked truncations.
    advantages: [B] (or [B, T] for per-token advantages).
    old_logprobs: log-probs of the policy that generated / was frozen for this data; None = on-policy, i.e.
        ``logprobs.detach()`` (ratio 1 with the gradient of the ratio).
    ref_logprobs: reference model log-probs, needed when the loss has ``beta != 0``.
    sampling_logprobs: log-probs reported by the rollout engine; when given, the loss corrects the
        train/inference mismatch with ``exp(old_logprobs - sampling_logprobs)`` (see `sampler_is_weights`).
        NaN entries mean "not reported" and get weight 1.
    entropy: per-token entropy of the policy (needed for ``top_entropy_quantile < 1`` and ``entropy_coef``).
    num_tokens, num_sequences: global normalisers (see module docstring); None = this micro-batch's.
    max_completion_length: the generation cap, the default Dr. GRPO constant.
    entropy_threshold: the entropy quantile threshold for ``top_entropy_quantile``; None = computed from
        this micro-batch (TRL's behaviour, exact only without accumulation). Compute it over the whole step
        with `cohort.algorithms.entropy_quantile_threshold` for an exact accumulated gradient.
    num_entropy_tokens: global count of tokens the entropy bonus acts on when ``top_entropy_quantile < 1``;
        None = this micro-batch's count of selected tokens.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampling_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    num_tokens: Count | None = None
    num_sequences: Count | None = None
    max_completion_length: int | None = None
    entropy_threshold: float | torch.Tensor | None = None
    num_entropy_tokens: Count | None = None


@dataclass
class LossOutput:
    """loss: scalar, already normalised by the global counts (sum micro-batch losses, never average them).
    metrics: detached partial values, reduced as `metric_reduction` says (TRL's names)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def metric_reduction(name: str) -> Literal["sum", "min", "max"]:
    """How to combine a metric over micro-batches and ranks: ``min``/``max`` by name suffix, else ``sum``."""
    if name.endswith("min"):
        return "min"
    if name.endswith("max"):
        return "max"
    return "sum"


def reduce_metrics(per_micro_batch: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """Combine `LossOutput.metrics` of the micro-batches of one step into final values (NaNs ignored by
    min/max, as TRL's ``nanmin``/``nanmax``)."""
    out: dict[str, torch.Tensor] = {}
    for metrics in per_micro_batch:
        for name, value in metrics.items():
            value = value.detach().to(torch.float64)
            if name not in out:
                out[name] = value
                continue
            op = metric_reduction(name)
            out[name] = torch.fmin(out[name], value) if op == "min" else (
                torch.fmax(out[name], value) if op == "max" else out[name] + value)
    if not out:
        return {}
    # one device-to-host read for all of them (each .item() would be a synchronisation of its own)
    values = list(out.values())
    device = values[0].device  # a metric on another device (a host-side count) joins the first one's
    return dict(zip(out, torch.stack([v.reshape(()).to(device) for v in values]).tolist()))


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: Count,
    num_sequences: Count,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``L`` [B, T] (or [B, 1], broadcast) with mask ``m`` to a scalar (verl names).

    - ``token-mean`` (DAPO, arXiv:2503.14476): ``sum_{i,t} L m / num_tokens``
    - ``seq-mean-token-mean`` (GRPO, arXiv:2402.03300): ``sum_i [sum_t L m / max(1, sum_t m)] / num_sequences``
    - ``seq-mean-token-sum``: ``sum_{i,t} L m / num_sequences``
    - ``seq-mean-token-sum-norm`` (Dr. GRPO, arXiv:2503.20783): ``sum_{i,t} L m / (num_sequences * C)``,
      ``C = loss_scale_factor`` (max_completion_length in Dr. GRPO).

    The counts are global (whole step), so summing the result over micro-batches gives the whole-batch value.
    """
    masked = per_token.expand_as(mask) * mask
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / num_sequences
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_sequences
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            raise ValueError(
                "aggregation 'seq-mean-token-sum-norm' (dr_grpo) needs a constant: set loss_scale_factor on the "
                "loss, or pass max_completion_length in LossInputs."
            )
        return masked.sum() / (num_sequences * loss_scale_factor)
    raise ValueError(f"aggregation={mode!r} is not supported; choose one of {', '.join(AGGREGATIONS)}.")

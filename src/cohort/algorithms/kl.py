"""Per-token estimators of KL(pi_theta || pi_ref) from sampled-token log-probabilities.

Tokens are sampled from pi_theta (or a close old policy), so with ``d = logp - ref_logp`` (``logp`` the
policy's log-probability of the sampled token) the estimators of Schulman, "Approximating KL divergence"
(http://joschu.net/blog/kl-approx.html, 2020) are:

=============  ======================  ================================================================
name           aliases                 value per token
=============  ======================  ================================================================
``k1``         ``kl``                  ``d`` (unbiased, high variance, can be negative)
``k2``         ``mse``                 ``d^2 / 2`` (biased value, but its gradient is the true KL's)
``k3``                                 ``exp(-d) + d - 1`` (unbiased, >= 0; GRPO arXiv:2402.03300 eq. 4)
``low_var_kl``                         k3 as verl computes it: ``-d`` clamped to [-20, 20], result to [-10, 10]
``abs``                                ``|d|``
``k1+`` ...    ``kl+``, ``k3+``,       straight-through: forward value of the named estimator, gradient of
               ``low_var_kl+``         k2 (verl ``core_algos.kl_penalty``); ``k2+``/``mse+`` equal ``k2``
=============  ======================  ================================================================

TRL's GRPO uses unclamped ``k3``; verl's ``low_var_kl`` clamps. Both are offered under distinct names so a
recipe ported from either reproduces it exactly.
"""

from __future__ import annotations

import torch

_ALIASES = {"kl": "k1", "mse": "k2"}
_BASE = ("k1", "k2", "k3", "low_var_kl", "abs")
KL_ESTIMATORS: tuple[str, ...] = (*_BASE, *_ALIASES, *(f"{n}+" for n in (*_BASE, *_ALIASES)))


def _forward_value(d: torch.Tensor, base: str) -> torch.Tensor:
    if base == "k1":
        return d
    if base == "k2":
        return 0.5 * d.square()
    if base == "abs":
        return d.abs()
    if base == "k3":
        return torch.exp(-d) + d - 1
    # low_var_kl: verl clamps the log-ratio before exp (overflow) and the result (outlier tokens).
    neg = torch.clamp(-d, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(neg) - neg - 1, min=-10.0, max=10.0)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman 2020; GRPO arXiv:2402.03300).

    ``d = logprobs - ref_logprobs``; ``k1 = d``, ``k2 = d^2/2``, ``k3 = exp(-d) + d - 1``, ``abs = |d|``,
    ``low_var_kl`` = verl's clamped k3. A trailing ``+`` (``k1+``, ``k3+``, ...) returns
    ``k2 - sg(k2) + sg(value)``: the forward value of the named estimator with the gradient of k2, which is
    the unbiased gradient of KL(pi_theta || pi_ref) on on-policy samples (verl's straight-through trick).
    Returns a tensor of the inputs' shape; masking and aggregation are the caller's job.
    """
    name = estimator.lower()
    straight_through = name.endswith("+")
    base = name.rstrip("+")
    base = _ALIASES.get(base, base)
    if base not in _BASE:
        raise ValueError(
            f"kl estimator={estimator!r} is not supported; choose one of {', '.join(KL_ESTIMATORS)}."
        )
    d = logprobs - ref_logprobs
    value = _forward_value(d, base)
    if not straight_through or base == "k2":
        return value
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value.detach()

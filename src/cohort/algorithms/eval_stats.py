"""Statistics of a sampled evaluation: unbiased pass@k, majority vote, mean accuracy, Wilson interval.

Pure functions of per-prompt correctness (and extracted answers); `cohort.evaluation` calls
`sampled_eval_metrics` with ``n = run.eval_num_samples`` completions per prompt.

- ``pass@k`` (Chen et al. 2021, arXiv:2107.03374, eq. 1): with ``c`` of a prompt's ``n`` samples correct,
  ``1 - C(n - c, k) / C(n, k)``, the chance that ``k`` samples drawn without replacement include a correct
  one; averaged over prompts. Reported for ``k = 1`` and every power of two below ``n`` (`pass_at_k_ks`); the
  evaluation's ``pass@n`` is the same estimator at ``k = n`` (a prompt counts when any sample is correct).
- ``maj@n``: per prompt, the most frequent extracted answer among the ``n`` (ties: the one seen first); the
  prompt scores the share of that answer's samples that were correct (0 or 1 when correctness follows from
  the answer); averaged over prompts.
- ``mean@n``: the mean correctness over all samples.
- Wilson score interval (Wilson 1927) for that mean, counting every sample as one Bernoulli trial. Samples of
  one prompt are correlated, so with ``n > 1`` the interval is narrower than one over independent prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` samples correct: ``1 - C(n - c, k) / C(n, k)``.

    >>> pass_at_k(5, 2, 2)  # 1 - C(3, 2) / C(5, 2) = 1 - 3 / 10
    0.7
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}) needs 0 <= c <= n and 1 <= k <= n.")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_ks(n: int) -> list[int]:
    """The k reported beside ``pass@n``: 1 and the powers of two below ``n`` (``n = 8``: 1, 2, 4)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; ``correct[p]`` holds prompt p's ``n`` sample outcomes."""
    return sum(pass_at_k(len(row), sum(map(bool, row)), k) for row in correct) / max(1, len(correct))


def majority_correct(answers: Sequence[str], correct: Sequence[bool]) -> float:
    """The share of correct samples among those giving the most frequent answer (ties: first seen).

    >>> majority_correct(["4", "5", "4", "5", "6"], [True, False, True, False, False])  # "4" first: 2 of 2
    1.0
    """
    if len(answers) != len(correct) or not answers:
        raise ValueError(f"majority_correct needs one outcome per answer, got {len(answers)} and {len(correct)}.")
    counts: dict[str, int] = {}
    for answer in answers:
        counts[answer] = counts.get(answer, 0) + 1
    winner = max(counts, key=lambda a: counts[a])  # max keeps the first of equal counts (insertion order)
    votes = [bool(ok) for a, ok in zip(answers, correct) if a == winner]
    return sum(votes) / len(votes)


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (95% by default); (0, 1) without trials.

    With ``p = successes / trials``: ``(p + z^2 / 2n +- z sqrt(p (1 - p) / n + z^2 / 4n^2)) / (1 + z^2 / n)``.
    """
    if trials <= 0:
        return 0.0, 1.0
    if not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: {successes} successes out of {trials} trials.")
    p = successes / trials
    z2 = z * z
    denom = 1.0 + z2 / trials
    centre = (p + z2 / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def sampled_eval_metrics(correct: Sequence[Sequence[bool]], answers: Sequence[Sequence[str]]) -> dict[str, float]:
    """``pass@k`` (k in `pass_at_k_ks`), ``maj@n``, ``mean@n``, ``accuracy_ci_low`` / ``accuracy_ci_high``.

    correct / answers: per prompt, its ``n`` samples' outcomes and extracted answers (every prompt has n).
    """
    if not correct:
        return {}
    n = len(correct[0])
    if any(len(row) != n for row in correct) or len(answers) != len(correct):
        raise ValueError("sampled_eval_metrics needs n outcomes and n answers for every prompt.")
    out = {f"pass@{k}": mean_pass_at_k(correct, k) for k in pass_at_k_ks(n)}
    out[f"maj@{n}"] = sum(majority_correct(a, c) for a, c in zip(answers, correct)) / len(correct)
    hits = sum(sum(map(bool, row)) for row in correct)
    out[f"mean@{n}"] = hits / (n * len(correct))
    out["accuracy_ci_low"], out["accuracy_ci_high"] = wilson_interval(hits, n * len(correct))
    return out

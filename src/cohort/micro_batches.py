"""Micro-batch planning: which of a step's sequences share one packed forward/backward.

`split_micro_batches` cuts sequences into micro-batches under a token budget with similar token counts;
`spread_micro_batches` re-cuts them into a fixed count, so every rank of sharded training runs the same
number of forwards. Pure index arithmetic on sequence lengths (no tensors).
"""

from __future__ import annotations

from collections.abc import Sequence


def split_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Cut sequences (by total token length) into micro-batches of at most `token_budget` tokens.

    Every index appears in exactly one micro-batch; a sequence longer than the budget sits alone in its
    own. The number of micro-batches is the first-fit-decreasing count; the sequences are then spread over
    that many bins longest-first into the least-loaded bin that fits, so micro-batches carry similar token
    counts (if that spread cannot fit, the first-fit-decreasing packing is kept). Indices inside a
    micro-batch are ascending; micro-batches are ordered by their first index. Deterministic.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1 (tokens per forward/backward)")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ffd: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        slot = next((b for b, used in enumerate(loads) if used + n <= token_budget), None)
        if slot is None:
            ffd.append([i])
            loads.append(n)
        else:
            ffd[slot].append(i)
            loads[slot] += n
    balanced = _balance(order, lengths, token_budget, len(ffd))
    bins = balanced if balanced is not None else ffd
    return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])


def spread_micro_batches(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """`bins` re-cut into exactly `count` micro-batches (sharded training: every rank must run the same number
    of forwards, since each one gathers parameters collectively). The micro-batch with the most tokens is
    halved until there are enough; when there are fewer sequences than `count`, empty micro-batches pad the
    list (the caller runs them as a zero-weight pass)."""
    out = [list(b) for b in bins]
    while len(out) < count:
        splittable = [b for b in out if len(b) > 1]
        if not splittable:
            break
        big = max(splittable, key=lambda b: (sum(lengths[i] for i in b), -b[0]))
        out.remove(big)
        out += [big[: len(big) // 2], big[len(big) // 2:]]
    out.sort(key=lambda b: b[0])
    return out + [[] for _ in range(count - len(out))]


def _balance(order, lengths, budget, k):
    """Longest-first into the least-loaded of k bins; None when some sequence does not fit."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in order:
        b = min(range(k), key=lambda j: (loads[j], j))
        if loads[b] and loads[b] + lengths[i] > budget:
            return None
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins

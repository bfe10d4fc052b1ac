"""Micro-batch planning: which of a step's sequences share one packed forward/backward.

`split_micro_batches` cuts sequences into micro-batches under a token budget with similar token counts;
`split_grouped_micro_batches` does the same for rows that hold each prompt once (train.share_prompts,
cohort.forward.shared_prompts), keeping the completions of a prompt together; `spread_micro_batches` re-cuts them into
a fixed count, so every rank of sharded training runs the same number of forwards. Pure index arithmetic on
sequence lengths (no tensors).
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


def split_grouped_micro_batches(groups: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                                completion_lens: Sequence[int], token_budget: int) -> list[list[int]]:
    """Micro-batches of rows where the completions of one prompt share a single copy of it.

    groups: indices of sequences with the same prompt (cohort.forward.shared_prompts.prompt_groups). A group costs its
    prompt once plus its completions; one that exceeds the budget is cut into runs of members that fit (each
    run paying for the prompt; a member that cannot fit even alone sits alone). The units are then cut as
    `split_micro_batches` cuts sequences, so a row never exceeds the budget that the memory plan sized. Same
    output contract as split_micro_batches.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget} must be >= 1 (tokens per forward/backward)")
    units: list[list[int]] = []
    costs: list[int] = []
    for group in groups:
        prompt = prompt_lens[group[0]]
        run: list[int] = []
        cost = prompt
        for i in group:
            if run and cost + completion_lens[i] > token_budget:
                units.append(run)
                costs.append(cost)
                run, cost = [], prompt
            run.append(i)
            cost += completion_lens[i]
        if run:
            units.append(run)
            costs.append(cost)
    bins = split_micro_batches(costs, token_budget)
    return sorted((sorted(i for u in b for i in units[u]) for b in bins), key=lambda b: b[0])


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

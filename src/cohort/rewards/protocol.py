"""The reward function contract (TRL's), the result of scoring a batch, and the reward error type.

A reward function is any callable

    fn(prompts, completions, completion_ids, trainer_state=..., **columns) -> list[float | None]

called with keyword arguments only; `def` or `async def`. `prompts[i]` and `completions[i]` are text
(standard format) or message lists (conversational: the completion is `[{"role": "assistant", "content":
...}]`), `completion_ids[i]` a list of token ids, and every dataset column other than `prompt` arrives under
its own name, one value per completion. `None` means "not applicable to this sample" (multi-task data); it
becomes NaN and is ignored by the per-function statistics and by the weighted sum.

Unlike TRL, a function does not have to accept `**kwargs`: it receives only the arguments it names.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cohort.errors import CohortError

# log_metric(name, value) / log_extra(column, values): TRL 1.16's hooks for a reward function to log a scalar
# (averaged over the step, logged under `name`) or a per-sample column (kept on the RewardResult)
RESERVED_ARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


class RewardError(CohortError):
    """A reward function failed: the message names the function, the sample and the fix."""


class AllNoneRewardsError(RewardError):
    """Every reward function returned None for every completion of a training batch: nothing to learn from.
    The message names the functions and the fix (return a float, 0.0 when a function does not apply)."""


class RewardFunc(Protocol):
    def __call__(
        self, *, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float | None]: ...


def reward_name(fn: Any) -> str:
    """The name used in metrics (`rewards/<name>/mean`): an explicit `name` or `__name__`, else the class name."""
    for attr in ("name", "__name__"):
        value = getattr(fn, attr, None)
        if isinstance(value, str) and value and value != "<lambda>":
            return value
    func = getattr(fn, "func", None)  # functools.partial
    if func is not None:
        return reward_name(func)
    return type(fn).__name__


def completion_text(completion: Any) -> str:
    """The text of a completion in either format (the last message's content when conversational)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def excerpt(value: Any, limit: int = 80) -> str:
    text = completion_text(value).replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def accepted_kwargs(fn: Callable[..., Any]) -> tuple[set[str] | None, set[str]]:
    """(names the function accepts, or None when it takes **kwargs; names it requires without default).

    Keywords already bound by functools.partial are neither accepted nor required: a dataset column of the
    same name must not override a setting the user bound.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None, set()
    bound = set(getattr(fn, "keywords", None) or {})
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in bound]
    required = {p.name for p in named if p.default is p.empty}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None, required
    return {p.name for p in named}, required


def to_reward(value: Any) -> float | None:
    """A returned value as a float, None kept; raises TypeError/ValueError for anything that is not a finite number."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if hasattr(value, "item") and not isinstance(value, numbers.Number):  # numpy scalars
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{type(value).__name__} {value!r} is not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{out} is not finite")
    return out


def nanstd(x: torch.Tensor) -> float:
    """Sample standard deviation (Bessel-corrected, as TRL) ignoring NaN; NaN with fewer than 2 values."""
    x = x[~torch.isnan(x)]
    return float(x.std()) if x.numel() > 1 else float("nan")


@dataclass
class RewardResult:
    """Rewards of N completions by F functions.

    rewards: [N, F] float32, NaN where a function returned None or its sample was skipped (`per_func` is
    the same tensor). names: the F metric names. weights: [F]. num_errors: per function, samples skipped
    by on_error="skip". logged: scalars the functions passed to `log_metric`; extra: columns passed to
    `log_extra` (one value per sample).
    """

    rewards: torch.Tensor
    names: list[str]
    weights: torch.Tensor
    num_errors: dict[str, int] = field(default_factory=dict)
    logged: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def per_func(self) -> torch.Tensor:
        return self.rewards

    @property
    def total(self) -> torch.Tensor:
        """[N] weighted sum over functions with NaN treated as 0 (TRL's `nansum`), the reward for advantages."""
        return (self.rewards * self.weights.unsqueeze(0)).nansum(dim=1)

    @property
    def mean(self) -> dict[str, float]:
        return {n: float(torch.nanmean(self.rewards[:, i])) for i, n in enumerate(self.names)}

    @property
    def std(self) -> dict[str, float]:
        return {n: nanstd(self.rewards[:, i]) for i, n in enumerate(self.names)}

    @property
    def all_none_rows(self) -> list[int]:
        """Samples for which no function gave a reward (TRL warns about these)."""
        return torch.isnan(self.rewards).all(dim=1).nonzero().flatten().tolist()

    def select(self, rows: Sequence[int]) -> RewardResult:
        """The result restricted to `rows` (e.g. the groups dynamic sampling keeps); error counts kept."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        n = self.rewards.shape[0]
        extra = {k: [v[r] for r in rows] for k, v in self.extra.items() if len(v) == n}
        return RewardResult(self.rewards[index], list(self.names), self.weights, dict(self.num_errors),
                            {k: list(v) for k, v in self.logged.items()}, extra)

    @classmethod
    def concat(cls, results: Sequence[RewardResult]) -> RewardResult:
        """Several results of the same functions stacked along N (error counts summed)."""
        first = results[0]
        if any(r.names != first.names for r in results):
            raise ValueError(f"cannot concatenate reward results of different functions: {[r.names for r in results]}")
        errors = {n: sum(r.num_errors.get(n, 0) for r in results) for n in first.names}
        logged: dict[str, list[float]] = {}
        for r in results:
            for k, v in r.logged.items():
                logged.setdefault(k, []).extend(v)
        columns = set().union(*(r.extra for r in results))
        extra = {k: [x for r in results for x in r.extra.get(k, [None] * r.rewards.shape[0])] for k in columns}
        return cls(torch.cat([r.rewards for r in results]), list(first.names), first.weights, errors, logged, extra)

    def metrics(self) -> dict[str, float]:
        """`rewards/<name>/mean|std` (TRL's names) plus `rewards/<name>/num_errors` when samples were skipped."""
        out: dict[str, float] = {}
        mean, std = self.mean, self.std
        for n in self.names:
            out[f"rewards/{n}/mean"] = mean[n]
            out[f"rewards/{n}/std"] = std[n]
            if self.num_errors.get(n):
                out[f"rewards/{n}/num_errors"] = float(self.num_errors[n])
        for name, values in self.logged.items():  # log_metric: averaged over the step, as TRL 1.16
            out[name] = sum(values) / len(values)
        return out


def unique_names(funcs: Sequence[Any]) -> list[str]:
    """Metric names, with `_2`, `_3`, ... appended to repeats so that no two functions share a metric."""
    names: list[str] = []
    for fn in funcs:
        base = reward_name(fn)
        name, k = base, 2
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names

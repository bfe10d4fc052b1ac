"""Run several reward functions on a batch of completions and combine them: `RewardRunner`.

Async functions are started first on one shared event loop (a daemon thread), so they run concurrently with
each other and with the sync functions, which run next in the calling thread. Every call has a time limit
(`timeout_s`, 300 s unless set; None: no limit), enforced for every kind of function (`cohort.rewards.limits`
for sync ones, `asyncio.wait_for` plus a deadline on the result for async ones, so a coroutine that blocks the
event loop is caught too). Every return value is checked: a raise, a timeout, a wrong number of values, or a
value that is not a finite number gives a `RewardError` naming the function, the sample and the fix; with
`on_error="skip"` the sample gets NaN for that function instead and is counted. A function that raises on the
batch is re-run one sample at a time to find which sample fails, so the error names it (and, when skipping,
the other samples keep their rewards). A training batch in which no function scored any completion (all None)
is an `AllNoneRewardsError`: it would train on zero advantages; an evaluation batch only warns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from cohort.errors import ConfigError
from cohort.rewards.limits import Outcome, call_with_limit
from cohort.rewards.protocol import (
    RESERVED_ARGS,
    AllNoneRewardsError,
    RewardError,
    RewardResult,
    accepted_kwargs,
    excerpt,
    to_reward,
    unique_names,
)
from cohort.rewards.registry import get_reward_function

OnError = Literal["raise", "skip"]
DEFAULT_TIMEOUT_S = 300.0  # reward.timeout_s's default: a call that takes longer is an error, not a hang


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for all async reward functions of the process, on a daemon thread (as TRL does)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="cohort-reward-loop", daemon=True).start()
        return _loop


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


class RewardRunner:
    """Score completions with reward functions; `__call__` returns a `RewardResult` ([N, F] with NaN).

    funcs: callables, builtin names ("accuracy", ...) or import paths ("pkg.mod:fn").
    weights: one per function (default all 1.0), used by `RewardResult.total`.
    timeout_s: per function call (default 300 s); None waits forever. on_error: "raise" or "skip" (see module
    docstring).
    """

    def __init__(
        self,
        funcs: Sequence[Any] | Any,
        weights: Sequence[float] | None = None,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        on_error: OnError = "raise",
        allow_empty: bool = False,
    ):
        funcs = list(funcs) if isinstance(funcs, list | tuple) else [funcs]
        if not funcs and not allow_empty:  # allow_empty: environments add their get_reward later (with_functions)
            raise ConfigError("reward_funcs is empty; give at least one reward function (e.g. 'accuracy').")
        self.funcs: list[Callable[..., Any]] = [get_reward_function(f) if isinstance(f, str) else f for f in funcs]
        self.names = unique_names(self.funcs)
        if weights is None:
            weights = [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise ConfigError(
                f"reward_weights has {len(weights)} values for {len(self.funcs)} reward functions {self.names}; "
                "give one weight per function, in the same order."
            )
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error={on_error!r}; use 'raise' or 'skip'.")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"reward timeout_s={timeout_s} must be > 0 (or None for no limit).")
        self.weights = torch.tensor([float(w) for w in weights], dtype=torch.float32)
        self.timeout_s = timeout_s
        self.on_error = on_error
        self._signatures = [accepted_kwargs(f) for f in self.funcs]
        self._bound = [set(getattr(f, "keywords", None) or {}) for f in self.funcs]  # functools.partial settings
        self.total_errors = dict.fromkeys(self.names, 0)  # cumulative over the run, for the final report

    def with_functions(self, extra: Sequence[Callable[..., Any]]) -> RewardRunner:
        """This runner with `extra` functions appended at weight 1 (TRL's environments' get_reward)."""
        return RewardRunner(self.funcs + list(extra), self.weights.tolist() + [1.0] * len(extra),
                            timeout_s=self.timeout_s, on_error=self.on_error)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, Sequence[Any]] | None = None,
        trainer_state: Any = None,
    ) -> RewardResult:
        n = len(prompts)
        columns = dict(columns or {})
        _check_lengths(n, completions, completion_ids, columns)
        logged: dict[str, list[float]] = {}
        extra: dict[str, list[Any]] = {}
        batch = {
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": [list(c) for c in completion_ids],
            "trainer_state": trainer_state,
            "log_metric": lambda name, value: logged.setdefault(str(name), []).append(float(value)),
            "log_extra": lambda column, values: extra.setdefault(str(column), []).extend(values),
            **{k: list(v) for k, v in columns.items() if k not in RESERVED_ARGS},
        }
        per_func = torch.full((n, len(self.funcs)), float("nan"), dtype=torch.float32)
        errors = dict.fromkeys(self.names, 0)
        calls = {i: self._kwargs_for(i, batch) for i in range(len(self.funcs))}
        # Start every async function before running the sync ones, so they all overlap.
        started = time.monotonic()
        pending = {i: self._submit_async(i, calls[i]) for i in calls if _is_async(self.funcs[i])}
        outcomes = {i: self._run_sync(i, kw) for i, kw in calls.items() if i not in pending}
        outcomes.update({i: self._await(future, started) for i, future in pending.items()})
        for i in calls:
            per_func[:, i] = self._finish(i, outcomes[i], batch, errors)
        for name, k in errors.items():
            self.total_errors[name] += k
        if n and not any(errors.values()) and bool(torch.isnan(per_func).all()):
            self._all_none(batch, trainer_state)
        return RewardResult(per_func, list(self.names), self.weights.clone(), errors, logged, extra)

    def _all_none(self, batch: dict[str, Any], trainer_state: Any) -> None:
        """Every function returned None for every completion: in training, an error (the step would train on
        zero advantages, silently); in evaluation (`trainer_state.is_eval`), a warning."""
        n = len(batch["prompts"])
        names = ", ".join(repr(name) for name in self.names)
        what = (f"Reward function{'s' if len(self.names) > 1 else ''} {names} returned None for all {n} "
                f"completions of the batch (first prompt {excerpt(batch['prompts'][0])})")
        if getattr(trainer_state, "is_eval", False):
            warnings.warn(f"{what}: these completions count as reward 0 in the evaluation.", stacklevel=3)
            return
        raise AllNoneRewardsError(
            f"{what}: no completion has a reward, so the step would train with zero loss. Fix: return a float "
            "for every completion (0.0 when the function does not apply to it), or add a reward function that "
            "scores these prompts (None is for multi-task data, where another function scores the sample)."
        )

    # -- calling -------------------------------------------------------------------------------------
    def _kwargs_for(self, i: int, batch: dict[str, Any]) -> dict[str, Any]:
        accepted, required = self._signatures[i]
        missing = sorted(required - set(batch))
        if missing:
            columns = sorted(k for k in batch if k not in RESERVED_ARGS)
            raise RewardError(
                f"Reward function {self.names[i]!r} needs argument(s) {missing}, but the dataset columns are "
                f"{columns}. Add the column(s) to the dataset (or rename one with columns={{'old': 'new'}})."
            )
        if accepted is None:
            return {k: v for k, v in batch.items() if k not in self._bound[i]}
        return {k: v for k, v in batch.items() if k in accepted}

    def _run_sync(self, i: int, kwargs: dict[str, Any]) -> Outcome:
        return call_with_limit(self.funcs[i], kwargs, self.timeout_s, self.names[i])

    def _submit_async(self, i: int, kwargs: dict[str, Any]):
        async def guarded() -> tuple[str, Any]:
            try:
                return "ok", await asyncio.wait_for(self.funcs[i](**kwargs), self.timeout_s)
            except TimeoutError:
                return "timeout", None
            except Exception as e:
                return "error", e

        return asyncio.run_coroutine_threadsafe(guarded(), _event_loop())

    def _await(self, future: concurrent.futures.Future, started: float) -> Outcome:
        """An async function's outcome. wait_for cancels a coroutine at the limit only when it awaits; one that
        blocks the event loop (time.sleep in an async def) is caught by this deadline, a little later."""
        if self.timeout_s is None:
            return future.result()
        left = started + self.timeout_s * 1.1 + 0.1 - time.monotonic()
        try:
            return future.result(timeout=max(left, 0.0))
        except concurrent.futures.TimeoutError:
            future.cancel()
            return "timeout", None

    def _call_one(self, i: int, kwargs: dict[str, Any]) -> Outcome:
        if _is_async(self.funcs[i]):
            return self._await(self._submit_async(i, kwargs), time.monotonic())
        return self._run_sync(i, kwargs)

    # -- checking ------------------------------------------------------------------------------------
    def _finish(self, i: int, outcome: Outcome, batch: dict[str, Any], errors: dict[str, int]) -> torch.Tensor:
        status, value = outcome
        n = len(batch["prompts"])
        if status == "timeout":
            return self._fail_batch(i, batch, errors, f"timed out after {self.timeout_s} s",
                                    "make it faster, or raise its limit reward.timeout_s (null: no limit)")
        if status == "error":
            return self._locate_error(i, batch, errors, value)
        if not isinstance(value, list | tuple) and not (isinstance(value, torch.Tensor) and value.dim() == 1):
            raise RewardError(
                f"Reward function {self.names[i]!r} returned a {type(value).__name__}, not a list. Return one "
                f"float (or None) per completion, {n} in all."
            )
        values = list(value)
        if len(values) != n:
            raise RewardError(
                f"Reward function {self.names[i]!r} returned {len(values)} values for {n} completions. Return "
                "exactly one float (or None) per completion, in the order of `completions`."
            )
        out = torch.full((n,), float("nan"))
        for j, v in enumerate(values):
            try:
                r = to_reward(v)
            except (TypeError, ValueError) as e:
                self._sample_error(i, j, batch, errors, f"returned {e}", "return a finite float, or None when the sample does not apply")
                continue
            if r is not None:
                out[j] = r
        return out

    def _locate_error(self, i: int, batch: dict[str, Any], errors: dict[str, int], error: Exception) -> torch.Tensor:
        """Re-run the function one sample at a time to find which samples raise."""
        n = len(batch["prompts"])
        out = torch.full((n,), float("nan"))
        found = False
        for j in range(n):
            one = {k: (v[j : j + 1] if isinstance(v, list) else v) for k, v in self._kwargs_for(i, batch).items()}
            status, value = self._call_one(i, one)
            if status == "ok" and isinstance(value, list | tuple) and len(value) == 1:
                try:
                    r = to_reward(value[0])
                    out[j] = float("nan") if r is None else r
                    continue
                except (TypeError, ValueError):
                    pass
            found = True
            err = value if status == "error" else error
            self._sample_error(i, j, batch, errors, f"raised {type(err).__name__}: {err}", "fix the function or the sample", cause=err)
        if not found:
            # Fails on the whole batch but on no single sample: nothing to pin it on.
            return self._fail_batch(i, batch, errors, f"raised {type(error).__name__}: {error}", "fix the function", cause=error)
        return out

    def _sample_error(
        self, i: int, j: int, batch: dict[str, Any], errors: dict[str, int], what: str, fix: str, cause: Exception | None = None
    ) -> None:
        if self.on_error == "skip":
            errors[self.names[i]] += 1
            return
        raise RewardError(
            f"Reward function {self.names[i]!r} {what} on sample {j} of {len(batch['prompts'])} (prompt "
            f"{excerpt(batch['prompts'][j])}, completion {excerpt(batch['completions'][j])}). Fix: {fix}, or set "
            "on_error='skip' to give such samples NaN for this function and count them."
        ) from cause

    def _fail_batch(
        self, i: int, batch: dict[str, Any], errors: dict[str, int], what: str, fix: str, cause: Exception | None = None
    ) -> torch.Tensor:
        n = len(batch["prompts"])
        if self.on_error == "skip":
            errors[self.names[i]] += n
            return torch.full((n,), float("nan"))
        raise RewardError(
            f"Reward function {self.names[i]!r} {what} on a batch of {n} completions (samples 0..{n - 1}; first "
            f"prompt {excerpt(batch['prompts'][0])}). Fix: {fix}, or set on_error='skip' to give the batch NaN "
            "for this function and count it."
        ) from cause


def _check_lengths(n: int, completions: Sequence[Any], completion_ids: Sequence[Any], columns: dict[str, Sequence[Any]]) -> None:
    sizes = {"completions": len(completions), "completion_ids": len(completion_ids)}
    sizes.update({f"column {k!r}": len(v) for k, v in columns.items()})
    bad = {k: v for k, v in sizes.items() if v != n}
    if bad:
        raise ValueError(
            f"RewardRunner got {n} prompts but {bad}; pass one prompt, completion, id list and column value per "
            "completion (repeat each prompt's row num_generations times: PromptBatch.repeat)."
        )

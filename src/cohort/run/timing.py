"""Time per phase of a training step (`time/generate`, `time/reward`, `time/train`, ...).

    timer = PhaseTimer()
    with timer("generate"):
        ...
    with timer("train"):
        ...
    metrics.update(timer.pop())   # {"time/generate": 1.9, "time/train": 0.7}, and the totals restart

CUDA kernels run asynchronously, so the clock is read only after `torch.cuda.synchronize()` when CUDA is
in use; otherwise a phase would be charged for the kernels the previous phase queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def _cuda_sync() -> None:
    # is_initialized: never create a CUDA context just to time a CPU-only run.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseTimer:
    """Accumulates wall time per named phase until `pop()`; a phase entered twice adds up."""

    def __init__(
        self,
        prefix: str = "time/",
        *,
        sync: Callable[[], None] | None = _cuda_sync,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.prefix = prefix
        self._sync = sync or (lambda: None)
        self._clock = clock
        self._totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = self._clock()
        try:
            yield
        finally:
            self._sync()
            key = self.prefix + name
            self._totals[key] = self._totals.get(key, 0.0) + self._clock() - start

    def record(self, name: str, seconds: float) -> None:
        """Add a duration measured elsewhere (e.g. inside a phase) under its own name."""
        key = self.prefix + name
        self._totals[key] = self._totals.get(key, 0.0) + seconds

    def peek(self) -> dict[str, float]:
        """The totals so far, without resetting them."""
        return dict(self._totals)

    def pop(self) -> dict[str, float]:
        """The totals since the last pop (in first-entered order), then start again from zero."""
        totals, self._totals = self._totals, {}
        return totals


Timer = PhaseTimer  # the shorter name reads better at call sites that only time one thing

"""Typed callbacks of the training loop: what they are told, and the decision they may return.

A `Callback` overrides the methods it needs (each is a no-op by default). Only two return a `Decision`:
`before_log` (EVALUATE: evaluate at this step besides `run.eval_steps`) and `on_log` (STOP: end training after
this step, with its checkpoint unless `run.save_at_end` is false; SAVE: checkpoint this step besides
`run.save_steps`). Every other method only observes. The TRL facade's `TrainerCallback`s ride on this
(`cohort.trl_compat.callbacks`); the loop knows nothing else about them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class Decision(enum.Flag):
    CONTINUE = 0
    EVALUATE = enum.auto()
    SAVE = enum.auto()
    STOP = enum.auto()


class UpdateEvent(enum.Enum):
    """The moments of one optimiser update (a step runs mini_batches x num_iterations of them)."""

    BEGIN = "update_begin"
    PRE_OPTIMIZER_STEP = "pre_optimizer_step"  # gradients reduced and clipped
    OPTIMIZER_STEP = "optimizer_step"  # the step taken (or skipped for a non-finite value)
    END = "update_end"  # the schedule stepped, gradients zeroed


class Callback:
    def on_train_begin(self, step: int) -> None:
        """Before the first step (`step`: the step resumed from, 0 for a new run)."""

    def on_resume(self, step: int, saved: dict[str, Any]) -> None:
        """After a checkpoint is loaded; `saved`: what `checkpoint_state` returned when it was written."""

    def on_step_begin(self, step: int) -> None:
        """Before the step generates."""

    def on_update(self, step: int, event: UpdateEvent) -> None:
        """Each moment of each optimiser update of the step."""

    def before_log(self, step: int) -> Decision:
        """Before the step's metrics are logged: EVALUATE asks for a held-out evaluation at this step."""
        return Decision.CONTINUE

    def on_log(self, step: int, metrics: dict[str, Any]) -> Decision:
        """After the step's metrics are logged: STOP ends training after it, SAVE checkpoints it."""
        return Decision.CONTINUE

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        """JSON-able entries saved with a checkpoint (every rank asks; handed back by `on_resume`)."""
        return {}

    def on_save(self, step: int, path: Path | None) -> None:
        """After a checkpoint is written (`path`: its folder; None on ranks that write none)."""

    def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
        """After the final held-out evaluation."""

    def on_train_end(self, step: int) -> None:
        """After the last step and the final evaluation."""


class CallbackList:
    """The loop's callbacks as one: notifications go to each in order, decisions are combined."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = list(callbacks)
        bad = [c for c in self.callbacks if not isinstance(c, Callback)]
        if bad:
            raise TypeError(f"train(callbacks=...) takes cohort.run.callbacks.Callback instances, got {bad!r:.200}")

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def notify(self, method: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, method)(*args)

    def decide(self, method: str, *args: Any) -> Decision:
        decision = Decision.CONTINUE
        for callback in self.callbacks:  # every callback is asked, even after one decided
            decision |= getattr(callback, method)(*args) or Decision.CONTINUE
        return decision

    def checkpoint_state(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for callback in self.callbacks:
            state.update(callback.checkpoint_state(step))
        return state

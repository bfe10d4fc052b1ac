"""`RunState`: what a run has done so far, exactly what a checkpoint's trainer state holds.

The built objects of a run (model, engine, data, optimizer: `cohort.setup.Components`) never change after
set-up; everything that moves as training goes on is here, so saving and resuming are one record each way:
`to_trainer_state(config)` is the JSON a checkpoint stores, `from_trainer_state` reads it back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cohort.errors import CheckpointError


@dataclass
class RunState:
    step: int = 0  # the last step completed
    num_tokens: int = 0  # prompt + completion tokens trained on, all ranks, all steps (TRL's num_tokens)
    train_time_s: float = 0.0  # step time spent, over resumes (train.max_train_time_s counts it)
    nonfinite_streak: int = 0  # optimiser updates skipped in a row for a non-finite loss or gradient norm
    eval_before: dict[str, float] = field(default_factory=dict)  # the held-out metrics before training
    sampler: dict[str, Any] = field(default_factory=dict)  # the prompt sampler's position (PromptSampler)
    hooks: dict[str, Any] = field(default_factory=dict)  # what callbacks saved (Callback.checkpoint_state)

    def to_trainer_state(self, config: str) -> dict[str, Any]:
        """The checkpoint's trainer_state.json: this record and the run's config as YAML text (callbacks' state
        if any)."""
        return {"step": self.step, "sampler": self.sampler, "num_tokens": self.num_tokens,
                "train_time_s": self.train_time_s, "nonfinite_streak": self.nonfinite_streak,
                "eval_before": self.eval_before, "config": config,
                **({"hooks": self.hooks} if self.hooks else {})}

    @classmethod
    def from_trainer_state(cls, state: Mapping[str, Any]) -> RunState:
        """A checkpoint's trainer state read back (fields a checkpoint from an older version lacks default).

        Every field is checked: one missing (`step`, `sampler`) or of the wrong type is a one-line
        CheckpointError naming the field and its value.
        """
        if not isinstance(state, Mapping):
            raise _bad_state(f"is a {type(state).__name__}, not an object of fields")
        return cls(step=_field(state, "step", _COUNT), num_tokens=_field(state, "num_tokens", _COUNT, 0),
                   train_time_s=float(_field(state, "train_time_s", _SECONDS, 0.0)),
                   nonfinite_streak=_field(state, "nonfinite_streak", _COUNT, 0),
                   eval_before=dict(_field(state, "eval_before", _METRICS, {})),
                   sampler=dict(_field(state, "sampler", _OBJECT)), hooks=dict(_field(state, "hooks", _OBJECT, {})))


_MISSING = object()


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _seconds(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _metrics(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and _number(x) for k, x in v.items())


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# (check, what it expects)
_COUNT = (_count, "a whole number >= 0")
_SECONDS = (_seconds, "a finite number of seconds >= 0")
_METRICS = (_metrics, "an object of metric names to numbers")
_OBJECT = (lambda v: isinstance(v, dict), "an object")


def _field(state: Mapping[str, Any], name: str, kind: tuple[Callable[[Any], bool], str],
           default: Any = _MISSING) -> Any:
    value = state.get(name, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise _bad_state(f"has no field {name!r}")
        return default
    check, expected = kind
    if not check(value):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise _bad_state(f"field {name!r} is {shown} ({type(value).__name__}), expected {expected}")
    return value


def _bad_state(problem: str) -> CheckpointError:
    return CheckpointError(
        f"the checkpoint's trainer state (trainer_state.json) {problem}: it is damaged or was not written by "
        "cohort. Resume from another checkpoint (run.resume=<path to checkpoints/step-NNNNNN>) or start over "
        "(--overwrite)")

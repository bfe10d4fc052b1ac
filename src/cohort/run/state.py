"""`RunState`: what a run has done so far, exactly what a checkpoint's trainer state holds.

The built objects of a run (model, engine, data, optimizer: `cohort.setup.Components`) never change after
set-up; everything that moves as training goes on is here, so saving and resuming are one record each way:
`to_trainer_state(config)` is the JSON a checkpoint stores, `from_trainer_state` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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
        """A checkpoint's trainer state read back (fields a checkpoint from an older version lacks default)."""
        return cls(step=int(state["step"]), num_tokens=int(state.get("num_tokens", 0)),
                   train_time_s=float(state.get("train_time_s", 0.0)),
                   nonfinite_streak=int(state.get("nonfinite_streak", 0)),
                   eval_before=dict(state.get("eval_before", {})), sampler=dict(state["sampler"]),
                   hooks=dict(state.get("hooks", {})))

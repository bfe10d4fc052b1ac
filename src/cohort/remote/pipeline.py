"""Off-policy pipelining with bounded staleness (`train.max_staleness: k`, server placement).

A background thread collects the rollouts of step s (generate on the server, score, advantages) as soon as
the weights of step s - 1 - k have been pushed, so with k >= 1 the generation of steps t+1..t+k overlaps the
training of step t. Every request names the oldest version it accepts (engine.requiring), so each completion
is sampled with a policy at most k versions behind the one that trains on it (its recorded `version` shows
it). The loss then treats the engine's sampling logprobs as the behaviour policy: the sampler importance
weights (loss.sampler_is_*: truncated or masked IS) correct for the gap, and `sampling/importance_sampling_
ratio/*` report it beside `staleness/mean` and `staleness/max`.

k = 0 does not use this class: the trainer generates in its own thread, exactly as before.

Several trainer ranks: each runs its own pipeline over its own slice of the prompts; `produce` gathers rewards
over a process group reserved for these threads (distributed.thread_gatherer), never the default group the
update's collectives use.

Checkpoints: the sampler runs ahead of training by up to k + 1 steps, so the state saved after step t is the
one recorded before step t + 1 drew its prompts (`checkpoint_sampler`): a resumed run draws the same prompts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class RolloutPipeline:
    def __init__(self, engine, produce: Callable[[int], Any], sampler, *, start_step: int, max_steps: int,
                 max_staleness: int) -> None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness}: the pipeline is for k >= 1 (k = 0 is synchronous)")
        self.engine, self.produce, self.sampler = engine, produce, sampler
        self.k, self.start_step, self.max_steps = max_staleness, start_step, max_steps
        # the engine's version of the weights that step s trains from is base + s - 1
        self.base = engine.version - start_step
        self._results: dict[int, tuple[bool, Any]] = {}
        self._sampler_states: dict[int, dict] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cohort-rollout-pipeline", daemon=True)
        self._thread.start()

    def required_version(self, step: int) -> int:
        """The oldest policy version step `step` may sample with: k behind the one it trains from."""
        return self.base + step - 1 - self.k

    def _run(self) -> None:
        for step in range(self.start_step + 1, self.max_steps + 1):
            required = self.required_version(step)
            if not self.engine.wait_for_version(required, self._stop):
                return
            try:
                self._sampler_states[step] = self.sampler.state_dict()
                with self.engine.requiring(required):
                    result = (True, self.produce(step))
            except BaseException as exc:  # handed to the training thread, which raises it
                result = (False, exc)
            with self._cond:
                self._results[step] = result
                self._cond.notify_all()
            if not result[0] or self._stop.is_set():
                return

    def get(self, step: int):
        """The rollouts of `step` (waits for them); an error of the background thread is raised here."""
        with self._cond:
            self._cond.wait_for(lambda: step in self._results or not self._thread.is_alive())
            if step not in self._results:
                raise RuntimeError(f"the rollout pipeline stopped before step {step}")
            ok, value = self._results.pop(step)
        if not ok:
            raise value
        return value

    def checkpoint_sampler(self, step: int):
        """A stand-in for the sampler in a checkpoint saved after `step`: the state before step + 1 drew."""
        state = self._sampler_states.get(step + 1)
        for old in [s for s in self._sampler_states if s <= step]:
            del self._sampler_states[old]
        return _SamplerState(state if state is not None else self.sampler.state_dict())

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


class _SamplerState:
    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def staleness_metrics(versions, current: int) -> dict[str, float]:
    """staleness/mean and staleness/max of a step's completions: versions behind `current` (the version the
    step trains from).

    >>> staleness_metrics([3, 3, 2, 3], current=3)
    {'staleness/mean': 0.25, 'staleness/max': 1.0}
    """
    behind = [current - v for v in versions if v is not None]
    if not behind:
        return {}
    return {"staleness/mean": sum(behind) / len(behind), "staleness/max": float(max(behind))}

"""PhaseTimer: per-phase totals with a fake clock (no real timing), sync calls, pop resets."""

import pytest

from cohort.run.timing import PhaseTimer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_phases_accumulate_and_pop_resets():
    clock, syncs = FakeClock(), []
    timer = PhaseTimer(clock=clock, sync=lambda: syncs.append(1))
    with timer("generate"):
        clock.now += 2.0
    with timer("train"):
        clock.now += 0.5
    with timer("generate"):  # a second generate phase in the same step adds up
        clock.now += 1.0
    assert timer.peek() == {"time/generate": 3.0, "time/train": 0.5}
    assert len(syncs) == 6  # before and after each phase
    assert timer.pop() == {"time/generate": 3.0, "time/train": 0.5}
    assert timer.pop() == {}


def test_phase_that_raises_is_still_counted():
    clock = FakeClock()
    timer = PhaseTimer(prefix="t/", clock=clock, sync=None)
    with pytest.raises(ValueError), timer("reward"):
        clock.now += 4.0
        raise ValueError
    assert timer.pop() == {"t/reward": 4.0}


def test_default_timer_runs_on_cpu():
    timer = PhaseTimer()
    with timer("x"):
        sum(range(1000))
    (value,) = timer.pop().values()
    assert value >= 0.0

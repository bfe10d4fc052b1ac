"""Resume is exact: N steps straight give the same metrics as k steps, stop, resume, N - k steps."""

from __future__ import annotations

import math

from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.logging import read_jsonl
from cohort.trainer import train

VOLATILE = ("time", "step_time", "time/", "train_time")


def _rows(run_dir):
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}


def test_resume_equals_uninterrupted(tmp_path):
    n, k = 5, 2
    straight = toy_config(tmp_path / "a", steps=n)
    train(straight, toy_components(straight))

    first = toy_config(tmp_path / "b", steps=k)
    train(first, toy_components(first))
    resumed = toy_config(tmp_path / "b", steps=n)
    resumed.run.resume = True
    train(resumed, toy_components(resumed))  # a fresh process would rebuild everything, then load

    a, b = _rows(tmp_path / "a" / "run"), _rows(tmp_path / "b" / "run")
    assert sorted(a) == sorted(b) == list(range(1, n + 1))
    for step in range(1, n + 1):
        for key, value in a[step].items():
            if key.startswith(VOLATILE) or not isinstance(value, float):
                continue
            assert math.isclose(value, b[step][key], rel_tol=1e-5, abs_tol=1e-7), (step, key, value, b[step][key])

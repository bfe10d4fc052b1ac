"""Resume is exact: N steps straight give the same metrics as k steps, stop, resume, N - k steps."""

from __future__ import annotations

import math

import pytest
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.config import apply_overrides
from cohort.run.logging import read_jsonl
from cohort.trainer import train

VOLATILE = ("time", "step_time", "time/", "train_time")


def _rows(run_dir):
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}


# the low-memory setting's optimiser (moments in host memory, bucketed) must resume exactly too
LOW_MEMORY = ["train.master_weights=false", "train.optimizer_offload=true", "generation.release_kv_during_update=true"]


# FSDP on one process (a world of one): the sharded DCP checkpoint must resume exactly as well
@pytest.mark.parametrize("overrides", [[], LOW_MEMORY, ["train.sharding=fsdp"]],
                         ids=["default", "low-memory", "fsdp-one-process"])
def test_resume_equals_uninterrupted(tmp_path, overrides):
    n, k = 5, 2
    straight = apply_overrides(toy_config(tmp_path / "a", steps=n), overrides)
    train(straight, toy_components(straight))

    first = apply_overrides(toy_config(tmp_path / "b", steps=k), overrides)
    train(first, toy_components(first))
    resumed = apply_overrides(toy_config(tmp_path / "b", steps=n), overrides)
    resumed.run.resume = True
    train(resumed, toy_components(resumed))  # a fresh process would rebuild everything, then load

    a, b = _rows(tmp_path / "a" / "run"), _rows(tmp_path / "b" / "run")
    assert sorted(a) == sorted(b) == list(range(1, n + 1))
    for step in range(1, n + 1):
        for key, value in a[step].items():
            if key.startswith(VOLATILE) or not isinstance(value, float):
                continue
            assert math.isclose(value, b[step][key], rel_tol=1e-5, abs_tol=1e-7), (step, key, value, b[step][key])

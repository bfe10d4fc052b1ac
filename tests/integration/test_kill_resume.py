"""Fault injection: a training process SIGKILLed at a seeded random point (during generation, the update, or
mid-save), then `cohort train ... --resume`, logs the metrics of the uninterrupted run, step for step.

Each kill point is drawn from its seed: the point (generate, update, save_write, save_publish, after_save;
see tests/helpers/fault_hooks.py, which makes the child kill itself there) and the step. The default suite
runs 4 seeds (one of each kind but after_save); all 20 run under the `slow` marker:

    python -m pytest tests/integration/test_kill_resume.py -m slow      # the 16 further seeded kill points
    COHORT_SLOW_TESTS=1 python -m pytest tests/integration/test_kill_resume.py   # all 20
    python -m pytest tests/integration/test_kill_resume.py               # the 4 of the default suite
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tests.helpers.fault_hooks import POINTS
from tests.helpers.toy_task import write_toy_workspace

from cohort.run.logging import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
VOLATILE = ("time", "step_time", "time/", "train_time")
ALL_SEEDS = list(range(20))
DEFAULT_SEEDS = [0, 1, 2, 3]  # generate, update, save_write, save_publish


def kill_point(seed: int) -> tuple[str, int]:
    """The seeded kill point: the kind cycles through POINTS so that every kind is covered, the step is random."""
    return POINTS[seed % len(POINTS)], random.Random(seed).randint(1, STEPS)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_toy_workspace(tmp_path_factory.mktemp("ws"))


def cli(workspace, out: Path, *extra: str, kill: str | None = None) -> subprocess.CompletedProcess:
    model_dir, toy = workspace
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("COHORT_TEST_KILL", None)
    if kill:
        env["COHORT_TEST_KILL"] = kill
    args = [sys.executable, "-m", "cohort.cli", "train", f"model.name_or_path={model_dir}", f"data.source={toy}",
            "reward.funcs=[tests.helpers.fault_hooks:digit_share]", f"train.max_steps={STEPS}",
            "train.prompts_per_step=2", "generation.num_generations=4", "generation.max_completion_length=6",
            "train.learning_rate=1e-2", "run.save_steps=1", f"run.output_dir={out}", "run.report_to=[jsonl]",
            "train.device=cpu", *extra]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _reference(workspace, folder: Path) -> dict[int, dict]:
    done = cli(workspace, folder / "run")
    assert done.returncode == 0, done.stderr
    return _rows(folder / "run")


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory):
    return _reference(workspace, tmp_path_factory.mktemp("reference"))


def _rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}


def _kill_and_resume(workspace, tmp_path: Path, seed: int) -> dict[int, dict]:
    """Run the job with the seed's kill point, check it died there, resume it; its metric rows."""
    point, step = kill_point(seed)
    out = tmp_path / f"run-{seed}"
    killed = cli(workspace, out, kill=f"{point}:{step}")
    assert killed.returncode == -signal.SIGKILL, (point, step, killed.returncode, killed.stderr[-2000:])
    logged = sorted(_rows(out))
    assert not logged or logged[-1] <= step, (point, step, logged)  # it died in step `step`, not later
    resumed = cli(workspace, out, "--resume")
    assert resumed.returncode == 0, (point, step, resumed.stderr[-2000:])
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    return _rows(out)


def _compare(reference: dict[int, dict], got: dict[int, dict], seed: int) -> None:
    point, step = kill_point(seed)
    assert sorted(got) == sorted(reference) == list(range(1, STEPS + 1)), (point, step, sorted(got))
    for s in reference:
        for key, value in reference[s].items():
            if key.startswith(VOLATILE) or not isinstance(value, float):
                continue
            assert math.isclose(value, got[s][key], rel_tol=1e-5, abs_tol=1e-7), (point, step, s, key, value,
                                                                                   got[s][key])


def test_kill_points_cover_every_kind():
    assert {kill_point(s)[0] for s in ALL_SEEDS} == set(POINTS)
    assert {kill_point(s)[0] for s in DEFAULT_SEEDS} == set(POINTS) - {"after_save"}


def test_kill_and_resume_equals_uninterrupted(workspace, tmp_path):
    # the reference run and the 4 kill-and-resume runs side by side: each child is mostly Python start-up
    with ThreadPoolExecutor(max_workers=len(DEFAULT_SEEDS) + 1) as pool:
        reference = pool.submit(_reference, workspace, tmp_path / "reference")
        runs = {seed: pool.submit(_kill_and_resume, workspace, tmp_path, seed) for seed in DEFAULT_SEEDS}
        for seed, run in runs.items():
            _compare(reference.result(), run.result(), seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [s for s in ALL_SEEDS if s not in DEFAULT_SEEDS])
def test_kill_and_resume_equals_uninterrupted_all_seeds(request, workspace, tmp_path, seed):
    # the default suite (`python -m pytest`, no -m) skips these; `-m slow` or COHORT_SLOW_TESTS=1 runs them
    if "slow" not in (request.config.option.markexpr or "") and not os.environ.get("COHORT_SLOW_TESTS"):
        pytest.skip("16 more kill points (about 20 s each): run with -m slow or COHORT_SLOW_TESTS=1")
    _compare(request.getfixturevalue("reference"), _kill_and_resume(workspace, tmp_path, seed), seed)

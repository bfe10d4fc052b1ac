"""A failing or stuck rank ends a torchrun launch quickly, non-zero, with a line naming the rank and the phase.

Each test launches `torchrun --standalone --nproc-per-node 2 -m cohort.cli train ...` (as
`python -m torch.distributed.run`, the module behind the torchrun script) on the CPU (gloo) with a tiny model
and a reward function from tests/helpers/dist_rewards.py that misbehaves on rank 1 at step 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.helpers.toy_task import write_toy_workspace

from cohort.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_toy_workspace(tmp_path_factory.mktemp("ws"))


def train_args(workspace, out: Path, reward: str, *overrides: str) -> list[str]:
    model_dir, toy = workspace
    return ["-m", "cohort.cli", "train", f"model.name_or_path={model_dir}", f"data.source={toy}",
            f"reward.funcs=[{reward}]", "train.max_steps=3", "train.prompts_per_step=2",
            "generation.num_generations=2", "generation.max_completion_length=4", f"run.output_dir={out}",
            "run.report_to=[jsonl]", *overrides]


def launch(torchrun_args: list[str], args: list[str], timeout: float = 90) -> tuple[int, str, float]:
    """Run one torchrun launcher to its end; returns its exit status, stdout+stderr and seconds taken."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun_args, *args], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, time.monotonic() - started


TWO_RANKS = ["--standalone", "--nproc-per-node", "2"]


def test_a_rank_whose_reward_raises_ends_the_launch(workspace, tmp_path):
    code, out, seconds = launch(TWO_RANKS, train_args(workspace, tmp_path / "run",
                                                      "tests.helpers.dist_rewards:fails_on_rank1_at_step2",
                                                      "train.dist_timeout_s=10"))
    assert code != 0, out
    assert seconds < 60, (seconds, out)
    assert "cohort: rank 1 of 2 failed during generate at step 2: RewardError:" in out, out
    assert "reward backend unreachable from rank 1" in out, out


def test_a_rank_stuck_before_a_collective_times_out_its_peer(workspace, tmp_path):
    # rank 1 sleeps 120 s in its reward function at step 2; rank 0 waits in the reward gather and must give up
    # after train.dist_timeout_s=5, name its phase, and end the launch (torchrun then stops rank 1)
    code, out, seconds = launch(TWO_RANKS, train_args(workspace, tmp_path / "run",
                                                      "tests.helpers.dist_rewards:stalls_on_rank1_at_step2",
                                                      "train.dist_timeout_s=5"))
    assert code != 0, out
    assert seconds < 60, (seconds, out)
    assert "cohort: rank 0 of 2 failed during generate at step 2: RuntimeError:" in out, out
    assert "Timed out" in out, out


@pytest.mark.parametrize("override", ["train.max_train_time_s=0", "run.time_limit_s=-5",
                                      "train.dist_timeout_s=0"])
def test_time_limits_must_be_positive(override, capsys, tmp_path):
    # a missing model would fail later: the time limit must be refused first, before any model loads
    code = main(["train", "model.name_or_path=/no/such/model", f"run.output_dir={tmp_path / 'run'}", override])
    err = capsys.readouterr().err
    assert code == 2, err
    name, value = override.split("=")
    assert f"{name}={float(value)!r} is not valid" in err and "positive number of seconds" in err, err
    assert "/no/such/model" not in err
    assert not (tmp_path / "run").exists()

"""bench/async_learning_seeds.sh and bench/serve_learning_seeds.sh, orchestration only: a fake `python3` first on
PATH stands for torch (GPUs), the trainer and the helpers, and records when each run starts and ends. Checked:
at most PER_GPU runs per GPU at once (eight at once overflowed one H200), GPUS picks the GPUs, a failed run is
counted and named while the others still finish, MODES runs only the asynchronous side, STALENESS sets the
asynchronous runs' max_staleness and names their files."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the fake interpreter: `-c "...device_count..."` prints the GPU count, `-m cohort.cli train` sleeps, logs
# start/end with its CUDA_VISIBLE_DEVICES and writes metrics (seed 2's k=1 run fails), the rest prints a line
FAKE = r"""#!/usr/bin/env bash
log=$FAKE_LOG
case "$*" in
  *device_count*) echo 2 ;;
  *"cohort.cli train"*)
    out=""; seed=""; async=0; k=none
    for a in "$@"; do case "$a" in run.output_dir=*) out=${a#run.output_dir=} ;; train.seed=*) seed=${a#train.seed=} ;;
      train.async_rollouts=true|train.max_staleness=1) async=1 ;; esac
      case "$a" in train.max_staleness=*) k=${a#train.max_staleness=} ;; esac; done
    echo "start $seed $async k=$k gpu=$CUDA_VISIBLE_DEVICES" >> "$log"; sleep "${FAKE_SLEEP:-1}"
    echo "end $seed $async" >> "$log"
    [ "$seed$async" = 21 ] && { echo "boom" >&2; exit 3; }
    mkdir -p "$out"; echo '{"step": 0}' > "$out/metrics.jsonl" ;;
  *) [ -n "${FAKE_ARGS_LOG:-}" ] && echo "$*" >> "$FAKE_ARGS_LOG"; echo "fake python3: $*" ;;
esac
"""


@pytest.fixture
def fake_env(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE)
    (bin_dir / "python3").chmod(0o755)
    log = tmp_path / "log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "MODEL": "m"}
    return env, log, tmp_path / "out"


def _max_at_once(lines: list[str]) -> int:
    running = peak = 0
    for line in lines:
        running += 1 if line.startswith("start") else -1
        peak = max(peak, running)
    return peak


def _start_fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def test_async_seeds_throttle_count_failures_and_pick_gpus(fake_env):
    env, log, out = fake_env
    env.update(PER_GPU="1", GPUS="1")
    proc = subprocess.run(["bash", "bench/async_learning_seeds.sh", "5", str(out), "1", "2", "3"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    lines = log.read_text().splitlines()
    assert sum(line.startswith("start") for line in lines) == 6  # 3 seeds x (k=0, k=1)
    assert _max_at_once(lines) == 1  # PER_GPU=1 on the one GPU chosen
    assert {line.split("gpu=")[1] for line in lines if line.startswith("start")} == {"1"}
    assert proc.returncode == 1 and "1 run(s) failed" in proc.stderr, proc.stderr
    assert (out / "seed2_k1.rc").read_text().strip() != "0" and (out / "seed3_k1.rc").read_text().strip() == "0"
    assert (out / "seed3_k1_metrics.jsonl").is_file()  # the runs after the failed one still ran
    assert {_start_fields(line)["k"] for line in lines if line.startswith("start")} == {"none", "1"}


def test_async_seeds_staleness_sets_the_bound_and_the_file_names(fake_env, tmp_path):
    env, log, out = fake_env
    env.update(PER_GPU="2", STALENESS="2", FAKE_ARGS_LOG=str(tmp_path / "args"))
    proc = subprocess.run(["bash", "bench/async_learning_seeds.sh", "5", str(out), "3", "4"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    starts = [_start_fields(line) for line in log.read_text().splitlines() if line.startswith("start")]
    assert sorted(start["k"] for start in starts) == ["2", "2", "none", "none"]
    assert (out / "seed3_k2_metrics.jsonl").is_file() and (out / "seed4_k0_metrics.jsonl").is_file()
    assert not list(out.glob("seed*_k1*"))
    manifest_call = [line for line in (tmp_path / "args").read_text().splitlines() if "manifest.py" in line]
    assert manifest_call and "seed3_k2_metrics.jsonl" in manifest_call[0] and "STALENESS=2" in manifest_call[0]


def test_async_seeds_refuse_a_staleness_below_one(fake_env):
    env, _, out = fake_env
    env.update(STALENESS="0")
    proc = subprocess.run(["bash", "bench/async_learning_seeds.sh", "5", str(out), "1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "STALENESS must be at least 1" in proc.stderr


def test_async_seeds_modes_and_two_per_gpu(fake_env):
    env, log, out = fake_env
    env.update(PER_GPU="2", MODES="1", FAKE_SLEEP="4")  # one wave of 4 runs: they overlap even on a loaded machine
    proc = subprocess.run(["bash", "bench/async_learning_seeds.sh", "5", str(out), "1", "3", "4", "5"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start")]
    assert len(starts) == 4 and all(line.split()[2] == "1" for line in starts)  # only the asynchronous runs
    assert 2 < _max_at_once(lines) <= 4  # 2 per GPU on the fake's 2 GPUs
    assert {line.split("gpu=")[1] for line in starts} == {"0", "1"}


def test_served_seeds_throttle_and_count_failures(fake_env):
    env, log, out = fake_env
    env.update(PER_GPU="1", COHORT_API_KEY="k")
    proc = subprocess.run(["bash", "bench/serve_learning_seeds.sh", "5", str(out), "1", "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = log.read_text().splitlines()
    assert sum(line.startswith("start") for line in lines) == 4
    assert _max_at_once(lines) <= 2  # 1 per GPU on the fake's 2 GPUs
    assert proc.returncode == 1 and "1 run(s) failed" in proc.stderr, proc.stderr
    assert (out / "seed1_k0_metrics.jsonl").is_file() and (out / "seed2_k0_metrics.jsonl").is_file()


def test_served_seeds_staleness_names_the_runs(fake_env):
    env, log, out = fake_env
    env.update(PER_GPU="2", COHORT_API_KEY="k", STALENESS="2")
    proc = subprocess.run(["bash", "bench/serve_learning_seeds.sh", "5", str(out), "3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    starts = [_start_fields(line) for line in log.read_text().splitlines() if line.startswith("start")]
    assert sorted(start["k"] for start in starts) == ["0", "2"]  # serve_learning.sh passes train.max_staleness=K
    assert (out / "seed3_k2_metrics.jsonl").is_file()

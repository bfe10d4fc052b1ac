"""The TRL facade under torchrun: a TRL-style script (tests/helpers/trl_facade_script.py) launched with
`python -m torch.distributed.run --standalone --nproc-per-node 2` on the CPU (gloo) trains one model: TRL's batch
arithmetic counts both ranks, every rank logs the same rows and ends with the same weights, rank 0 alone writes
the checkpoints and the saved model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.toy_task import write_toy_workspace

pytest.importorskip("datasets", reason="needs datasets: pip install datasets")
REPO = Path(__file__).resolve().parents[2]
_WALL_CLOCK = ("step_time", "train_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def test_the_facade_trains_under_torchrun_and_the_ranks_agree(tmp_path):
    model_dir, _ = write_toy_workspace(tmp_path / "ws")
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "tests/helpers/trl_facade_script.py", str(model_dir), str(out)], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    r0, r1 = (json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert (r0["world"], r1["world"]) == (2, 2)
    assert (r0["is_world_process_zero"], r1["is_world_process_zero"]) == (True, False)
    # per_device_train_batch_size=4 on 2 ranks: 8 completions a generation, 2 prompts of 4 (TRL's arithmetic)
    assert r0["prompts_per_step"] == 2 and r0["global_step"] == r1["global_step"] == 2
    assert r0["weights"] == r1["weights"]  # the ranks stay in lockstep
    assert [row["step"] for row in r0["log_history"]] == [1, 2, 2]
    for a, b in zip(r0["log_history"], r1["log_history"], strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/") and k not in _WALL_CLOCK} == \
               {k: v for k, v in b.items() if not k.startswith("time/") and k not in _WALL_CLOCK}
    assert r0["log_history"][0]["reward_std"] >= 0 and "loss" in r0["log_history"][0]
    assert sorted(p.name for p in (out / "run" / "checkpoints").glob("step-*")) == ["step-000001", "step-000002"]
    assert (out / "final" / "config.json").is_file()

"""Where a run directory's files live (config, metrics, checkpoints), and which checkpoint is the newest complete one.

`run_dir/checkpoints/` holds one `step-NNNNNN/` folder per saved step, a `latest` file naming the newest, and,
while a save is in flight (or after one crashed), hidden `.tmp-*` folders that are never picked up. A step
folder is complete once it holds trainer_state.json, written after everything but manifest.json (every file's
size and SHA-256, checked before a load reads anything: `cohort.checkpointing.manifest`); both are in the
temporary folder before it is renamed into place. `.cohort.lock` in the run directory is held by the run
using it (`cohort.run.directory.hold_run_lock`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"

LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".cohort.lock"
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` lives (whether or not it exists)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:06d}"


def rank_rng_file(rank: int) -> str:
    """The name of rank `rank`'s RNG file in a checkpoint saved sharded."""
    return f"rng-{rank}.pt"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under `root` (a run's checkpoints/), oldest first."""
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            match = STEP_DIR.match(entry.name)
            if match and (entry / TRAINER_STATE_FILE).is_file():
                found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run, or None if it has none.

    `latest` is trusted when it names a complete checkpoint; otherwise (missing, or a crash between the
    rename and the pointer update) the highest complete `step-*` directory wins.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    pointer = root / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8").strip()
        candidate = root / name
        if STEP_DIR.match(name) and (candidate / TRAINER_STATE_FILE).is_file():
            return candidate
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None

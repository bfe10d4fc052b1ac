"""How many checkpoints a run keeps (`keep_last`, from run.save_total_limit) and deleting the older ones."""

from __future__ import annotations

import shutil
from pathlib import Path

from cohort.errors import ConfigError
from cohort.run.layout import complete_checkpoints


def check_keep_last(keep_last: int | None) -> None:
    """Refuse a `keep_last` below 1 before anything is written (None keeps every checkpoint)."""
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last={keep_last!r}: keep at least 1 checkpoint, or pass None to keep all")


def prune(root: Path, keep_last: int, protect: Path) -> None:
    """Delete all but the newest `keep_last` complete checkpoints under `root`, never `protect` (the one
    just saved, even when an older run left higher steps)."""
    checkpoints = complete_checkpoints(root)
    for _step, path in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)

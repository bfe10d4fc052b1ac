"""What a saved checkpoint holds, for the log and for resume: its size on disk and whether it has optimizer
state (a run.save_only_model checkpoint has none)."""

from __future__ import annotations

import os
from pathlib import Path

from cohort.checkpointing.manifest import check_listing, read_manifest
from cohort.errors import CheckpointError
from cohort.run.layout import OPTIMIZER_FILE


def checkpoint_size(path: str | os.PathLike) -> dict[str, int]:
    """Bytes on disk of a checkpoint folder: {"total", "optimizer" (optimizer.pt or dcp/ optimizer shards
    cannot be told apart from the model's there, so dcp/ counts as "sharded state")}."""
    path = Path(path)
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path):
        for name in filenames:
            total += os.path.getsize(os.path.join(dirpath, name))
    optimizer = path / OPTIMIZER_FILE
    return {"total": total, "optimizer": optimizer.stat().st_size if optimizer.is_file() else 0}


def describe_size(path: str | os.PathLike) -> str:
    """One line for the log: a checkpoint's size on disk and how much of it is optimizer state."""
    size = checkpoint_size(path)
    text = f"{_human_bytes(size['total'])} on disk"
    if size["optimizer"]:
        text += f" ({_human_bytes(size['optimizer'])} of it optimizer state; run.save_only_model=true leaves it out)"
    elif _saved_without_optimizer(Path(path)):
        text += " (weights only: run.save_only_model)"
    return text


def _saved_without_optimizer(path: Path) -> bool:
    """What the manifest records, for the log line alone: an unreadable one (a stale view of a shared
    filesystem on another rank, say) is reported by the load that needs it, not here."""
    try:
        return not read_manifest(path).optimizer_state
    except CheckpointError:
        return False


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def has_optimizer_state(path: str | os.PathLike) -> bool:
    """Whether a checkpoint holds optimizer state (not when saved with run.save_only_model), as its manifest
    records it. The manifest and the folder's listing are checked first (a CheckpointError for a checkpoint
    without manifest, a missing, resized or unlisted file: a missing optimizer.pt is damage, not a weights-only
    checkpoint); `load_checkpoint` checks the hashes before it reads anything."""
    return check_listing(Path(path)).optimizer_state

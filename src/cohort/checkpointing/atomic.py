"""The atomic publish protocol that the unsharded and the sharded save share.

A checkpoint is written into a hidden temporary sibling (`.tmp-step-000100-<id>/`); trainer_state.json is
written after every other file (a folder without it is incomplete by construction), then manifest.json (every
file's size and SHA-256, `cohort.checkpointing.manifest`), the tree is fsynced, renamed into place with
`os.replace`, and only then is `latest` replaced atomically and older checkpoints pruned. A crash at any
point leaves the previous checkpoint whole and `latest` pointing at it; the next save sweeps the temporaries.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cohort.checkpointing.manifest import FileEntry, write_manifest
from cohort.checkpointing.retention import prune
from cohort.errors import ConfigError
from cohort.run.directory import atomic_write_text, fsync_dir
from cohort.run.layout import LATEST_FILE, TMP_PREFIX, TRAINER_STATE_FILE


def temporary_dir(root: Path, final: Path) -> Path:
    """A fresh hidden temporary path under `root` for the checkpoint that will become `final`."""
    return root / f"{TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"


def trainer_state_json(step: int, trainer_state: Mapping[str, Any]) -> str:
    """The text of trainer_state.json; a ConfigError naming the keys that are not JSON (checked before any
    file is written)."""
    state = {**trainer_state, "step": int(step), "saved_at": time.time()}
    try:
        return json.dumps(state, indent=2, allow_nan=False)
    except (TypeError, ValueError) as e:
        bad = [k for k, v in state.items() if not _json_ok(v)]
        raise ConfigError(
            f"trainer_state for checkpoint step {step} is not JSON: key(s) {bad} ({e}); pass plain numbers, "
            "strings, lists and dicts (turn tensors into floats or lists, NaN into None)"
        ) from e


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def complete_and_publish(tmp: Path, final: Path, state_text: str, keep_last: int | None, *,
                         optimizer_state: bool, known: Mapping[str, FileEntry] | None = None) -> None:
    """Write trainer_state.json (a directory without it is incomplete by construction), then the manifest of
    every file (`known`: entries the ranks of a sharded save hashed already; `optimizer_state`: whether the
    optimizer was saved), fsync, rename into place, point `latest` at it, prune; a failure removes the
    temporary and leaves `latest` as it was."""
    try:
        (tmp / TRAINER_STATE_FILE).write_text(state_text, encoding="utf-8")
        write_manifest(tmp, optimizer_state=optimizer_state, known=known)
        _fsync_tree(tmp)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(final.parent / LATEST_FILE, final.name + "\n")
    if keep_last is not None:
        prune(final.parent, keep_last, protect=final)


def _fsync_tree(directory: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def fsync_file(file: str | os.PathLike) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved aside first."""
    old = None
    if final.exists():
        # A directory rename cannot replace a non-empty directory, so park the old one under a hidden name.
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sweep_temporaries(root: Path) -> None:
    """Delete temporaries left by a save that crashed (one process writes a run's checkpoints at a time)."""
    for entry in root.iterdir():
        if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)

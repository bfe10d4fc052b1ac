"""The run directory: creating it safely, removing it when a run dies before producing anything, and
writing files into it atomically.

A run directory holds `config.yaml`, `metrics.jsonl`, `samples.jsonl`, `checkpoints/` and `tensorboard/`.
Three rules keep it trustworthy:

- a non-empty directory is never reused silently: the user says `--resume` or `--overwrite` (or picks
  another `output_dir`);
- `--overwrite` only deletes a directory that looks like a cohort run, so a typo such as
  `output_dir=~` cannot wipe a home directory;
- a run that fails before its first metric row or checkpoint leaves no directory behind
  (`run_dir_guard`), so a bad input never leaves a half-written run that blocks the next attempt.
"""

from __future__ import annotations

import contextlib
import enum
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from cohort.errors import ConfigError
from cohort.run.layout import CHECKPOINTS_DIR, CONFIG_FILE, METRICS_FILE, latest_checkpoint

# Any of these marks a directory as a cohort run directory that --overwrite may delete.
_RUN_MARKERS = (CONFIG_FILE, METRICS_FILE, CHECKPOINTS_DIR, "samples.jsonl", "tensorboard")


# ----------------------------------------------------------------------------------------- atomic files
def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory entry (a rename or a new file) to disk; a no-op where the OS cannot do it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems (and Windows) refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so that readers see either the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


# ------------------------------------------------------------------------------------------- creation
def is_run_dir(path: str | os.PathLike) -> bool:
    """True if `path` contains any file cohort writes into a run directory."""
    path = Path(path)
    return any((path / marker).exists() for marker in _RUN_MARKERS)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and next(path.iterdir(), None) is None


def prepare_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> Path:
    """Create (or reuse, for `resume`) the run directory at `path` and return it.

    - new or empty directory: created, whatever the flags (resume then finds nothing to resume; the caller
      decides whether that is an error by calling `latest_checkpoint`);
    - non-empty and neither flag: `ConfigError` naming the path and the three ways out;
    - `resume`: the directory is kept as it is;
    - `overwrite`: the old run is deleted first, but only if it looks like a cohort run directory.
    """
    path = Path(path).expanduser()
    if resume and overwrite:
        raise ConfigError(
            f"resume=True and overwrite=True both given for output_dir {str(path)!r}: choose one "
            "(--resume continues the run there, --overwrite deletes it and starts again)"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir {str(path)!r} is a file, not a directory: choose another output_dir")
    if path.is_dir() and not _is_empty_dir(path):
        if resume:
            return path
        if not overwrite:
            raise ConfigError(
                f"output_dir {str(path)!r} already exists and is not empty: pass --resume to continue that "
                "run, --overwrite to delete it and start again, or choose another output_dir"
            )
        _delete_old_run(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _delete_old_run(path: Path) -> None:
    if not is_run_dir(path):
        raise ConfigError(
            f"--overwrite refuses to delete output_dir {str(path)!r}: it is not empty and does not look like a "
            f"cohort run directory (none of {', '.join(_RUN_MARKERS)} in it); choose another output_dir"
        )
    # Rename first so that a crash during the (slow) delete never leaves a half-deleted run under the name.
    trash = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def run_has_progress(path: str | os.PathLike) -> bool:
    """True once a run wrote something worth keeping: a metric row or a complete checkpoint."""
    path = Path(path)
    metrics = path / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    return latest_checkpoint(path) is not None


@contextlib.contextmanager
def run_dir_guard(path: str | os.PathLike, *, created: bool) -> Iterator[Path]:
    """Remove the run directory if the body raises before the run produced anything.

    `created` says whether this run created the directory (pass `not path.exists()` measured before
    `prepare_run_dir`, or use `open_run_dir`); a directory the run did not create (a resumed run, or one
    the user made) is never removed. A run that has logged metrics or saved a checkpoint is kept too, so a
    crash at step 500 can still be inspected and resumed.
    """
    path = Path(path)
    try:
        yield path
    except BaseException:
        if created and path.is_dir() and not run_has_progress(path):
            shutil.rmtree(path, ignore_errors=True)
        raise


@contextlib.contextmanager
def open_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> Iterator[Path]:
    """`prepare_run_dir` plus `run_dir_guard` in one: `with open_run_dir(p, resume=r, overwrite=o) as d:`."""
    path = Path(path).expanduser()
    # A missing directory is ours; so is one --overwrite wipes (nothing of the user's is left in it). An
    # empty directory the user made beforehand is left in place.
    created = not path.exists() or (overwrite and not resume and not _is_empty_dir(path))
    run_dir = prepare_run_dir(path, resume=resume, overwrite=overwrite)
    with run_dir_guard(run_dir, created=created):
        yield run_dir


# -------------------------------------------------------------------------------------- resolved config
def _to_yaml_safe(value: Any, where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return _to_yaml_safe(value.value, where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {str(k): _to_yaml_safe(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_to_yaml_safe(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ConfigError(
        f"config value {where or '<root>'} = {value!r} (type {type(value).__name__}) cannot be written to "
        f"{CONFIG_FILE}: convert it to a str, number, bool, list or dict first"
    )


def write_resolved_config(run_dir: str | os.PathLike, config_dict: Mapping[str, Any]) -> Path:
    """Write the fully resolved config as `run_dir/config.yaml` (atomically, keys in the given order)."""
    data = _to_yaml_safe(config_dict, "")
    text = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return atomic_write_text(Path(run_dir) / CONFIG_FILE, text)

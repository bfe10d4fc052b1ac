"""The run directory: creating it safely, removing it when a run dies before producing anything, and
writing files into it atomically.

A run directory holds `config.yaml`, `metrics.jsonl`, `samples.jsonl`, `checkpoints/` and `tensorboard/`.
Three rules keep it trustworthy:

- a non-empty directory is never reused silently: the user says `--resume` or `--overwrite` (or picks
  another `output_dir`);
- `--overwrite` only deletes a directory that looks like a cohort run, so a typo such as
  `output_dir=~` cannot wipe a home directory;
- a run that fails before its first metric row or checkpoint leaves no directory behind
  (`run_dir_guard`), so a bad input never leaves a half-written run that blocks the next attempt;
- one run at a time: `open_run_dir` holds `.cohort.lock` in the directory (`hold_run_lock`: an flock on an
  open file, held for the run's life, with the holder's pid, host and start time in it for the messages). A
  second run on the directory stops at once naming the holder; a lock left by a run that died (the kernel
  released its flock) is taken over with a message; the file is deleted when the run ends.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from cohort.errors import ConfigError, RunDirInUseError
from cohort.run.layout import CHECKPOINTS_DIR, CONFIG_FILE, LOCK_FILE, METRICS_FILE, latest_checkpoint

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
    """A directory with nothing in it but, perhaps, a run's lock file."""
    return path.is_dir() and all(entry.name == LOCK_FILE for entry in path.iterdir())


def _check_flags(path: Path, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise ConfigError(
            f"resume=True and overwrite=True both given for output_dir {str(path)!r}: choose one "
            "(--resume continues the run there, --overwrite deletes it and starts again)"
        )
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir {str(path)!r} is a file, not a directory: choose another output_dir")


def _check_contents(path: Path, *, resume: bool, overwrite: bool) -> None:
    if not path.is_dir() or _is_empty_dir(path) or resume:
        return
    if not overwrite:
        raise ConfigError(
            f"output_dir {str(path)!r} already exists and is not empty: pass --resume to continue that "
            "run, --overwrite to delete it and start again, or choose another output_dir"
        )
    if not is_run_dir(path):
        raise ConfigError(
            f"--overwrite refuses to delete output_dir {str(path)!r}: it is not empty and does not look like a "
            f"cohort run directory (none of {', '.join(_RUN_MARKERS)} in it); choose another output_dir"
        )


def prepare_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> Path:
    """Create (or reuse, for `resume`) the run directory at `path` and return it.

    - new or empty directory: created, whatever the flags (resume then finds nothing to resume; the caller
      decides whether that is an error by calling `latest_checkpoint`);
    - non-empty and neither flag: `ConfigError` naming the path and the three ways out;
    - `resume`: the directory is kept as it is;
    - `overwrite`: the old run is deleted first, but only if it looks like a cohort run directory.

    It takes no lock: `open_run_dir` does (and is what a run uses).
    """
    path = Path(path).expanduser()
    _check_flags(path, resume=resume, overwrite=overwrite)
    _check_contents(path, resume=resume, overwrite=overwrite)
    if overwrite and not resume and path.is_dir() and not _is_empty_dir(path):
        _delete_old_run(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _delete_old_run(path: Path, *, keep_lock: bool = False) -> None:
    """Delete the run at `path`, leaving an empty directory there (with `keep_lock`: holding only the lock file
    this process holds, the same open file, so the lock is never let go)."""
    # Rename first so that a crash during the (slow) delete never leaves a half-deleted run under the name.
    trash = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex[:8]}")
    os.replace(path, trash)
    try:
        if keep_lock:
            fresh = path.with_name(f".{path.name}.new-{uuid.uuid4().hex[:8]}")
            fresh.mkdir()
            os.replace(trash / LOCK_FILE, fresh / LOCK_FILE)
            try:
                os.rename(fresh, path)  # fails if another run made `path` (with its lock file) meanwhile
            except OSError as e:
                shutil.rmtree(fresh, ignore_errors=True)
                raise RunDirInUseError(
                    f"output_dir {str(path)!r} was taken by another cohort run while --overwrite cleared it "
                    f"({e.strerror}): stop that run, or choose another output_dir"
                ) from e
    finally:
        shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- lock
def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def hold_run_lock(run_dir: str | os.PathLike, *, echo: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Hold the lock of the run directory `run_dir` (which must exist) for the body; yields the lock file.

    Raises `RunDirInUseError` naming the holder (pid, host, start time) when another live process holds it;
    a lock file left by a process that died is taken over, with a message to `echo` (stderr by default). The
    lock is an flock on `.cohort.lock`, which the kernel releases when its holder dies; the file is deleted
    when the body ends.
    """
    file = Path(run_dir) / LOCK_FILE
    fd = _take_lock(file, echo or _to_stderr)
    try:
        yield file
    finally:
        with contextlib.suppress(OSError):
            if _same_file(fd, file):
                file.unlink()  # still locked: no other run can take a file that is about to vanish
        os.close(fd)


def _take_lock(file: Path, echo: Callable[[str], None]) -> int:
    for _attempt in range(10):
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirInUseError(
                f"output_dir {str(file.parent)!r} is in use by another cohort run ({holder or 'holder unknown'}; "
                f"lock file {str(file)!r}): wait for that run to end or stop it, or choose another output_dir"
            ) from None
        except OSError as e:  # a filesystem without locks (some network mounts): run, but say so
            echo(f"cohort: warning: cannot lock {str(file)!r} ({e.strerror}); a second run on this output_dir "
                 "would not be stopped")
        if _same_file(fd, file):
            break
        os.close(fd)  # its holder deleted it between our open and flock (that run ended): open it again
    else:
        raise RunDirInUseError(f"the lock file {str(file)!r} keeps being replaced: is another cohort run "
                               "starting on this output_dir? Choose another output_dir")
    previous = _holder(fd)
    if previous:
        echo(f"cohort: {str(file.parent)!r} was locked by a run that ended without releasing it ({previous}); "
             "this run takes the lock over")
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def _holder(fd: int) -> str:
    """The holder a lock file names ("pid 123 on host gpu-7, started ..."); "" for an empty file."""
    text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if not text:
        return ""
    try:
        record = json.loads(text)
        return f"pid {record['pid']} on host {record['host']}, started {record['started']}"
    except (ValueError, KeyError, TypeError):
        return f"an unreadable holder record {text[:60]!r}"


def _same_file(fd: int, file: Path) -> bool:
    try:
        on_disk = os.stat(file)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


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
def open_run_dir(path: str | os.PathLike, *, resume: bool, overwrite: bool,
                 echo: Callable[[str], None] | None = None) -> Iterator[Path]:
    """`prepare_run_dir`, `hold_run_lock` and `run_dir_guard` in one, for the run's life:
    `with open_run_dir(p, resume=r, overwrite=o) as d:`.

    The lock is taken before the directory's contents are judged or --overwrite deletes anything, so a
    second run stops with the holder's pid and host and never touches the first run's files; a command
    refused here leaves an existing directory as it was (the lock file goes again).
    """
    path = Path(path).expanduser()
    _check_flags(path, resume=resume, overwrite=overwrite)
    # A missing directory is ours; so is one --overwrite wipes (nothing of the user's is left in it). An
    # empty directory the user made beforehand is left in place.
    created = not path.exists() or (overwrite and not resume and not _is_empty_dir(path))
    path.mkdir(parents=True, exist_ok=True)
    with hold_run_lock(path, echo=echo):
        _check_contents(path, resume=resume, overwrite=overwrite)
        if overwrite and not resume and not _is_empty_dir(path):
            _delete_old_run(path, keep_lock=True)
        with run_dir_guard(path, created=created):
            yield path


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

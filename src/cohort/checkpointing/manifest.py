"""manifest.json: every file of a checkpoint with its size and SHA-256, written last at save, checked first at load.

    {"format": "cohort-checkpoint", "version": 1, "optimizer_state": true,
     "files": {"config.json": {"size": 612, "sha256": "9f2c..."}, "dcp/.metadata": {...}, ...}}

Save: `write_manifest` lists every file in the temporary folder (all ranks' files: a sharded save hashes them
on every rank, each its share, and rank 0 writes the one manifest) after trainer_state.json, right before the
folder is fsynced and renamed into place (`cohort.checkpointing.atomic`). `optimizer_state` records whether
the optimizer was saved (false under run.save_only_model), so a missing optimizer.pt is damage, not a
weights-only checkpoint.

Load: `verify_checkpoint` runs before anything in the folder is parsed (torch.load, safetensors, DCP's
metadata, trainer_state.json): a listed file that is missing, of another size or another hash, a file that is
not listed (a planted `dcp/.metadata`, say), a link or a damaged manifest.json is a one-line CheckpointError
naming the file, and nothing is loaded. `check_listing` is its cheap half (names and sizes, no hashing), for
`has_optimizer_state`.

Checkpoints saved before cohort wrote manifests have none and are refused with a message saying so: their
files cannot be checked. `python -m cohort.checkpointing.trust PATH` (`record_manifest`) records the files of
such a folder as they are now, for a user who trusts it.

The manifest detects damage and files changed, removed or added after the save; it is not a signature (whoever
can write the folder can rewrite manifest.json). What keeps a crafted file from running code is that nothing in
a checkpoint is unpickled without restriction: torch.load with weights_only=True, safetensors, JSON, and DCP's
metadata through `cohort.checkpointing.dcp_reader`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch.distributed as dist

from cohort.checkpointing import dcp_reader
from cohort.errors import CheckpointError, ConfigError
from cohort.run.directory import atomic_write_text
from cohort.run.layout import MANIFEST_FILE, OPTIMIZER_FILE, TRAINER_STATE_FILE

FORMAT = "cohort-checkpoint"
VERSION = 1
_CHUNK = 1 << 20  # bytes hashed at a time
_WORKERS = min(8, os.cpu_count() or 1)  # files hashed at once
_DCP_DIR = "dcp"  # cohort.checkpointing.dcp.DCP_DIR (that module imports this one)
_FIX = ("Nothing in it was loaded: resume from another checkpoint (run.resume=<path to checkpoints/step-NNNNNN>) "
        "or start over (--overwrite)")


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    optimizer_state: bool  # the optimizer was saved (false: run.save_only_model)
    files: dict[str, FileEntry]  # relative POSIX path -> size and hash


# ------------------------------------------------------------------------------------------------ hashing
def sha256_file(file: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(directory: Path, names: Sequence[str]) -> dict[str, FileEntry]:
    """Size and SHA-256 of each named file under `directory`, several files at a time (hashlib lets go of the
    GIL while it hashes); an OSError if one cannot be read."""
    def entry(name: str) -> FileEntry:
        return FileEntry(size=os.path.getsize(directory / name), sha256=sha256_file(directory / name))

    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        return dict(zip(names, pool.map(entry, names), strict=True))


def scan(directory: Path) -> tuple[dict[str, int], list[str]]:
    """Every regular file under `directory` but manifest.json ({relative POSIX path: size}), and what is not
    a regular file, as problem texts: links (a save never writes one; os.walk does not follow them into
    directories, so a linked `dcp/` would otherwise hide its files from the listing)."""
    files: dict[str, int] = {}
    odd: list[str] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            relative = Path(full).relative_to(directory).as_posix()
            if os.path.islink(full):
                odd.append(f"{full!r} is a symbolic link (a save writes plain files only)")
            elif name in filenames and relative != MANIFEST_FILE:
                if os.path.isfile(full):
                    files[relative] = os.path.getsize(full)
                else:
                    odd.append(f"{full!r} is not a regular file")
    return files, odd


# --------------------------------------------------------------------------------------------------- save
def write_manifest(directory: Path, *, optimizer_state: bool,
                   known: Mapping[str, FileEntry] | None = None) -> Manifest:
    """Hash every file in `directory` (those in `known` were hashed already, by the ranks that share a sharded
    save) and write manifest.json; call it after every other file is written."""
    known = known or {}
    present, odd = scan(directory)
    if odd:
        raise CheckpointError(f"checkpoint folder {str(directory)!r}: {odd[0]}")
    files = {**hash_files(directory, sorted(set(present) - set(known))), **known}
    files = {name: files[name] for name in sorted(files)}
    manifest = Manifest(optimizer_state=optimizer_state, files=files)
    body = {"format": FORMAT, "version": VERSION, "optimizer_state": optimizer_state,
            "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in files.items()}}
    atomic_write_text(directory / MANIFEST_FILE, json.dumps(body, indent=1) + "\n")
    return manifest


def record_manifest(path: str | os.PathLike) -> Manifest:
    """Write the manifest of a checkpoint saved before cohort wrote manifests, from its files as they are now.

    For a folder you trust (your own, unchanged since it was saved): afterwards it loads, and any later change
    is detected. Whether it holds optimizer state is read from its files (DCP's index through the restricted
    reader of `dcp_reader`).
    """
    path = Path(path)
    if not (path / TRAINER_STATE_FILE).is_file():
        raise ConfigError(f"{str(path)!r} is not a complete cohort checkpoint (no {TRAINER_STATE_FILE}): pass a "
                          "checkpoints/step-NNNNNN folder")
    if (path / MANIFEST_FILE).exists():
        raise CheckpointError(f"checkpoint {str(path)!r} has a {MANIFEST_FILE} already; nothing to record")
    dcp_dir = path / _DCP_DIR
    try:
        optimizer = (path / OPTIMIZER_FILE).is_file() or (dcp_dir.is_dir() and dcp_reader.has_optimizer_shards(dcp_dir))
    except Exception as e:  # OSError, a truncated or refused pickle
        raise CheckpointError(f"checkpoint {str(path)!r}: {str(dcp_dir / dcp_reader.METADATA_FILE)!r} cannot be "
                              f"read ({type(e).__name__}: {e}); its manifest was not written") from e
    return write_manifest(path, optimizer_state=optimizer)


# --------------------------------------------------------------------------------------------------- load
def read_manifest(path: Path) -> Manifest:
    """manifest.json of the checkpoint `path`, parsed and checked field by field."""
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no {MANIFEST_FILE}: it was saved by a cohort version that did not record "
            "its files' hashes (or the file was removed), so it cannot be checked for damage or tampering and is not "
            "loaded. Resume from a checkpoint saved by this version or start over (--overwrite); if you trust this "
            f"folder (your own, unchanged since it was saved), record its files with `python -m "
            f"cohort.checkpointing.trust {path}` and resume again")
    try:
        body = json.loads(file.read_text(encoding="utf-8"))
        return _parse(body)
    except (OSError, ValueError) as e:  # json's errors are ValueErrors, and so are _parse's
        raise CheckpointError(f"checkpoint {str(path)!r}: {str(file)!r} is damaged ({e}). {_FIX}") from e


def _parse(body: Any) -> Manifest:
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} manifest")
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"version {version!r}")
    if version > VERSION:
        raise ValueError(f"format version {version} is newer than this cohort reads ({VERSION}): upgrade cohort")
    optimizer, listed = body.get("optimizer_state"), body.get("files")
    if not isinstance(optimizer, bool) or not isinstance(listed, dict):
        raise ValueError("'optimizer_state' must be true or false and 'files' an object")
    files = {}
    for name, entry in listed.items():
        size, sha = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if not _relative(name) or not isinstance(size, int) or isinstance(size, bool) or size < 0 or not (
                isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
            raise ValueError(f"entry {name!r}: {entry!r}")
        files[name] = FileEntry(size=size, sha256=sha)
    return Manifest(optimizer_state=optimizer, files=files)


def _relative(name: Any) -> bool:
    """A plain relative path inside the folder (no `..`, not absolute, normalised), as a save writes them."""
    if not isinstance(name, str) or not name or name == MANIFEST_FILE:
        return False
    parts = PurePosixPath(name).parts
    return not name.startswith("/") and ".." not in parts and "/".join(parts) == name


def check_listing(path: Path) -> Manifest:
    """The cheap half of `verify_checkpoint`: manifest.json, and every file there, of its size, none more."""
    manifest = read_manifest(path)
    present, problems = scan(path)
    for name, entry in manifest.files.items():
        file = path / name
        size = file.stat().st_size if file.is_file() else None  # by name: a stale listing does not hide it
        if size is None:
            problems.append(f"{str(file)!r} is missing ({MANIFEST_FILE} lists it, {entry.size} bytes)")
        elif size != entry.size:
            problems.append(f"{str(file)!r} is truncated or damaged ({size} bytes, {MANIFEST_FILE} records "
                            f"{entry.size})")
    problems += [f"{str(path / name)!r} is not in {MANIFEST_FILE} (the save did not write it)"
                 for name in sorted(set(present) - set(manifest.files))]
    _raise_if(path, problems)
    return manifest


def check_hashes(path: Path, manifest: Manifest, share: tuple[int, int] = (0, 1)) -> None:
    """Hash the listed files (with `share` = (rank, world): every world-th file from the rank-th on)."""
    rank, world = share

    def problem(name: str) -> str | None:
        file = path / name
        try:
            same = sha256_file(file) == manifest.files[name].sha256
        except OSError as e:
            return f"{str(file)!r} cannot be read ({type(e).__name__}: {e})"
        return None if same else (f"{str(file)!r} is damaged or was changed (its SHA-256 is not the one "
                                  f"{MANIFEST_FILE} records)")

    with ThreadPoolExecutor(max_workers=_WORKERS) as pool:
        found = pool.map(problem, sorted(manifest.files)[rank::world])
        _raise_if(path, [p for p in found if p is not None])


def _raise_if(path: Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {str(path)!r} fails verification: checkpoint file {problems[0]}{more}. "
                              f"{_FIX}")


def verify_checkpoint(path: str | os.PathLike) -> Manifest:
    """Check every file of the checkpoint against its manifest.json; its manifest, or a CheckpointError."""
    path = Path(path)
    manifest = check_listing(path)
    check_hashes(path, manifest)
    return manifest


def verify_on_every_rank(path: str | os.PathLike) -> Manifest:
    """`verify_checkpoint` as a collective of the default process group: every rank checks the listing and
    hashes its share of the files, and all raise the first problem any rank found (none is left waiting)."""
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest, problem = None, None
    try:
        manifest = check_listing(path)
        check_hashes(path, manifest, share=(rank, world))
    except CheckpointError as e:
        problem = str(e)
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found or manifest is None:
        raise CheckpointError(found[0] if found else f"checkpoint {str(path)!r} fails verification")
    return manifest

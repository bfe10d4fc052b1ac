"""Reading a sharded (DCP) checkpoint without unpickling anything but DCP's own records.

torch.distributed.checkpoint stores its index, `dcp/.metadata`, as a pickle, and reads it, and the non-tensor
values of a state dict (the optimizer's hyperparameters), with an unrestricted unpickler: a crafted file there
would run code on load. cohort reads both more strictly:

- `read_metadata` unpickles `.metadata` with an unpickler that resolves only DCP's metadata records (the
  dataclasses of `torch.distributed.checkpoint.metadata`, its `_StorageInfo`), torch's `Size`, dtypes, layouts
  and memory formats, and paths; anything else is an `UnpicklingError` before it is called;
- `SafeReader` is DCP's `FileSystemReader` reading its metadata that way (and only the global `.metadata`,
  never a rank-local one);
- `SafeLoadPlanner` is DCP's default load planner reading non-tensor values with torch's safe loader
  (`weights_only=True`), as DCP already reads tensors.

This is the second line of defence: `cohort.checkpointing.manifest` checks every file against the hashes the
save recorded before any of this runs.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"
OPTIM_KEY = "optim"  # cohort saves {"model": ..., "optim": ...} (cohort.checkpointing.dcp)
OPTIMIZER_PREFIX = OPTIM_KEY + "."  # the flattened keys of the optimizer's state
# Globals a DCP .metadata refers to besides the classes of torch.distributed.checkpoint.metadata and torch's
# Size, dtypes, layouts and memory formats: none of them runs anything but its own constructor.
_OTHER_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
})


def _allowed(module: str, name: str) -> bool:
    if module == dcp_metadata.__name__:
        record = getattr(dcp_metadata, name, None)
        return isinstance(record, type) and record.__module__ == module
    if module == "torch":
        value = getattr(torch, name, None) if name.isidentifier() else None
        return name == "Size" or isinstance(value, torch.dtype | torch.layout | torch.memory_format)
    return (module, name) in _OTHER_GLOBALS


class _RecordsOnly(pickle.Unpickler):
    """An unpickler that resolves DCP's metadata records and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(
                f"{module}.{name} is not one of torch.distributed.checkpoint's metadata records; refused")
        return super().find_class(module, name)


def read_metadata(directory: Path) -> Metadata:
    """`directory/.metadata` (a DCP checkpoint's index) read with the restricted unpickler.

    Raises OSError (missing, unreadable), pickle.UnpicklingError (anything but DCP's records) or the errors of
    a truncated pickle (EOFError, ...); callers turn them into a CheckpointError naming the file.
    """
    with open(directory / METADATA_FILE, "rb") as f:
        metadata = _RecordsOnly(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def has_optimizer_shards(directory: Path) -> bool:
    """Whether a DCP checkpoint holds optimizer state (it does not when saved with run.save_only_model)."""
    return any(key.startswith(OPTIMIZER_PREFIX) for key in read_metadata(directory).state_dict_metadata)


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `read_metadata` above; it always reads the global `.metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()  # as FileSystemReader does
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with the non-tensor values read by torch's safe loader.

    The value is loaded with `weights_only=True` (tensors and plain containers only) and saved again, so what
    the default planner then unpickles was written by this process, not by whoever wrote the file.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        checked = torch.load(value, map_location="cpu", weights_only=True)
        buffer = io.BytesIO()
        torch.save(checked, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)

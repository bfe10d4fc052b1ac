"""`load_checkpoint`: exact resume, restoring a checkpoint into live objects in place.

Before anything in the folder is parsed, every file is checked against the checkpoint's manifest.json
(`cohort.checkpointing.manifest`: missing, changed or unlisted files, a checkpoint without a manifest); then
every .pt file is read with torch's safe loader (weights_only=True): cohort writes only tensors and plain
containers, and a tampered file cannot run code. A missing or unreadable file is a CheckpointError that names
it and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cohort.checkpointing import dcp
from cohort.checkpointing.errors import CheckpointError, damaged
from cohort.checkpointing.manifest import Manifest, verify_checkpoint, verify_on_every_rank
from cohort.checkpointing.rng import set_rng_state
from cohort.checkpointing.weights import load_model_weights, read_full_weights, unwrap_model
from cohort.errors import ConfigError
from cohort.run.layout import (
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    rank_rng_file,
)


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    map_location: str | torch.device = "cpu",
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint into existing objects in place and return its trainer_state dict.

    The model's weights are copied from the safetensors file(s) into `model` (same architecture expected;
    dtype and device of `model` are kept). Optimizer and scheduler states are restored when given.

    A checkpoint with `dcp/` (saved sharded) is read through torch.distributed.checkpoint: call this on every
    rank; the number of ranks may differ from the saving run's, and the live model may be sharded or not.
    An FSDP2-sharded model also loads an unsharded checkpoint's weights, but not its optimizer.pt.

    First every file is checked against manifest.json (a CheckpointError naming the first file missing,
    changed or not listed, and nothing loaded); when the load is collective (a process group, and `dcp/` or a
    sharded model), the ranks share the hashing.
    """
    path = Path(path)
    state_file = path / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise ConfigError(
            f"{str(path)!r} is not a complete cohort checkpoint (no {TRAINER_STATE_FILE}); pass a "
            f"checkpoints/step-NNNNNN directory, or a run directory to `latest_checkpoint` first"
        )
    manifest = _verified(path, model)
    if optimizer is not None and not manifest.optimizer_state:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved without optimizer state (no {OPTIMIZER_FILE}: run.save_only_model), "
            "so the optimizer cannot be restored; pass optimizer=None to load_checkpoint to load the weights alone"
        )
    if dcp.has_sharded_state(path):
        dcp.load_sharded_state(path, model, optimizer)
    elif dcp.is_sharded(model):
        if optimizer is not None:  # refuse before touching the model: no half-loaded state
            _refuse_unsharded_optimizer(path)
        dcp.load_full_weights(path, model, read_full_weights)
    else:
        load_model_weights(path, unwrap_model(model))
        if optimizer is not None:
            optimizer.load_state_dict(_torch_load(path / OPTIMIZER_FILE, map_location, "optimizer"))
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(path / SCHEDULER_FILE, map_location, "scheduler"))
    if restore_rng:
        set_rng_state(_torch_load(_rng_file(path, dcp.rank()), "cpu", "RNG"))
    try:
        return json.loads(state_file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise damaged(state_file, e) from e


def _verified(path: Path, model: torch.nn.Module) -> Manifest:
    """The checkpoint's manifest once every file matches it; collective where the load itself is."""
    collective = dist.is_available() and dist.is_initialized() and (
        dcp.has_sharded_state(path) or dcp.is_sharded(model))
    return verify_on_every_rank(path) if collective else verify_checkpoint(path)


def _rng_file(path: Path, rank: int) -> Path:
    """This rank's RNG file; rank 0's rng.pt where the checkpoint has none for it (saved on fewer ranks, or
    unsharded)."""
    own = path / rank_rng_file(rank)
    return own if own.is_file() else path / RNG_FILE


def _refuse_unsharded_optimizer(path: Path) -> None:
    raise CheckpointError(
        f"checkpoint {str(path)!r} was saved unsharded: its {OPTIMIZER_FILE} holds whole-tensor optimizer "
        "states keyed by parameter position, which cannot be converted into this FSDP-sharded optimizer. "
        "Either load the weights alone (load_checkpoint(..., optimizer=None): the optimizer starts afresh, "
        "Adam's moments from zero), or resume this checkpoint without sharding (train.sharding unset) and "
        "switch to sharding at a later run"
    )


def _torch_load(file: Path, map_location: Any, what: str) -> Any:
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(file.parent)!r} has no {file.name}, so the {what} state cannot be restored; "
            f"it was saved without one (pass {what}=None to load_checkpoint to skip it)"
        )
    # weights_only: our files hold only tensors and plain containers, so the safe loader suffices (and a
    # tampered file cannot run code).
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated (EOFError, RuntimeError), garbage (UnpicklingError), unsafe globals
        raise damaged(file, e) from e

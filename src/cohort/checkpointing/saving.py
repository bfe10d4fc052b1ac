"""`save_checkpoint`: the entry point of every save, and the save of a policy that is not sharded.

One process writes the policy in Hugging Face format (`save_pretrained`, safetensors), the tokenizer, the
optimizer and scheduler state dicts and the RNG state (torch.save of tensors and plain containers only, so
they load with weights_only=True) into a temporary folder, which `atomic.complete_and_publish` completes (the
trainer state, then the manifest of every file's hash) and puts in place.
An FSDP2-sharded policy goes to `sharded_saving` instead.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cohort.checkpointing import dcp
from cohort.checkpointing.atomic import (
    complete_and_publish,
    sweep_temporaries,
    temporary_dir,
    trainer_state_json,
)
from cohort.checkpointing.errors import CheckpointError
from cohort.checkpointing.retention import check_keep_last
from cohort.checkpointing.rng import rng_state
from cohort.checkpointing.sharded_saving import save_sharded
from cohort.checkpointing.weights import unwrap_model
from cohort.run.directory import CHECKPOINTS_DIR
from cohort.run.layout import (
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    checkpoint_path,
    latest_checkpoint,
)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    trainer_state: Mapping[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write the checkpoint of `step` atomically, point `latest` at it, prune to `keep_last`; return its path.

    For an FSDP2-sharded `model` this is collective: call it on every rank, with the same arguments (rank 0's
    tokenizer, scheduler and trainer_state are the ones written).
    """
    check_keep_last(keep_last)
    try:
        if _sharded(model):
            return save_sharded(run_dir, step, model, tokenizer, optimizer, scheduler, trainer_state, keep_last)
        return _save_unsharded(run_dir, step, model, tokenizer, optimizer, scheduler, trainer_state, keep_last)
    except OSError as e:  # disk full, permission, a vanished mount: the temporary is gone, `latest` unchanged
        previous = latest_checkpoint(run_dir)
        kept = (f"the last good checkpoint {str(previous)!r} and `latest` are unchanged" if previous is not None
                else "no earlier checkpoint exists")
        raise CheckpointError(
            f"saving checkpoint step {step} into {str(checkpoint_path(run_dir, step))!r} failed: "
            f"{type(e).__name__}: {e}; {kept}. Free disk space (run.save_total_limit, run.save_only_model) or fix "
            "the folder's permissions, then continue with --resume"
        ) from e


def _sharded(model: Any) -> bool:
    return dcp.is_sharded(model)


def _save_unsharded(run_dir: str | os.PathLike, step: int, model: Any, tokenizer: Any, optimizer: Any,
                    scheduler: Any, trainer_state: Mapping[str, Any], keep_last: int | None) -> Path:
    state_text = trainer_state_json(step, trainer_state)  # fail on bad state before writing anything
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(root)
    final = checkpoint_path(run_dir, step)
    tmp = temporary_dir(root, final)
    try:
        tmp.mkdir()
        _write_contents(tmp, model, tokenizer, optimizer, scheduler)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    complete_and_publish(tmp, final, state_text, keep_last, optimizer_state=optimizer is not None)
    return final


def _write_contents(directory: Path, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any) -> None:
    unwrap_model(model).save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    if scheduler is not None:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
    torch.save(rng_state(), directory / RNG_FILE)

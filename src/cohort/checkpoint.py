"""Atomic checkpoints and exact resume.

Layout of one checkpoint, `run_dir/checkpoints/step-000100/`:

    config.json, model.safetensors, ...   the policy in Hugging Face format: the directory itself loads with
                                          `AutoModelForCausalLM.from_pretrained` (for a PEFT model: the
                                          adapter, adapter_config.json + adapter_model.safetensors, which
                                          `peft.AutoPeftModelForCausalLM.from_pretrained` loads)
    tokenizer files                       when a tokenizer is given
    optimizer.pt, scheduler.pt            state dicts, when given
    rng.pt                                Python `random`, NumPy, torch CPU and every CUDA generator
    trainer_state.json                    step plus whatever JSON the trainer passes (data position, ...)

A policy sharded with FSDP2 (`fully_shard`, see `cohort.distributed.dcp`) is saved collectively, by every
rank, and its folder differs in two ways: `dcp/` replaces optimizer.pt (model and optimizer shards written by
torch.distributed.checkpoint, loadable on any number of ranks), and each rank r > 0 adds `rng-{r}.pt` beside
rank 0's rng.pt (also written as rng-0.pt). The Hugging Face files are still there, gathered by rank 0.

Atomicity: everything is written into a hidden sibling `.tmp-step-000100-<id>/`, fsynced, then renamed into
place with `os.replace`, and only then is `checkpoints/latest` (a one-line file naming the directory)
replaced atomically. A crash at any point leaves the previous checkpoint whole and `latest` pointing at it;
hidden temporary directories are never picked up and are swept by the next save. A sharded save keeps the
same guarantee across ranks: rank 0 names the temporary directory, every rank writes into it, and only once
every rank reports success does rank 0 rename it into place and move `latest`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from cohort.errors import CohortError, ConfigError
from cohort.run_dir import CHECKPOINTS_DIR, atomic_write_text, fsync_dir

LATEST_FILE = "latest"
TRAINER_STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"


class CheckpointError(CohortError):
    """A checkpoint that cannot be read or does not fit the model it is loaded into."""


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of `step` lives (whether or not it exists)."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:06d}"


# ------------------------------------------------------------------------------------------------ save
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
    if keep_last is not None and keep_last < 1:
        raise ConfigError(f"keep_last={keep_last!r}: keep at least 1 checkpoint, or pass None to keep all")
    try:
        if _sharded(model):
            return _save_sharded(run_dir, step, model, tokenizer, optimizer, scheduler, trainer_state, keep_last)
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


def _save_unsharded(run_dir: str | os.PathLike, step: int, model: Any, tokenizer: Any, optimizer: Any,
                    scheduler: Any, trainer_state: Mapping[str, Any], keep_last: int | None) -> Path:
    state_text = _trainer_state_json(step, trainer_state)  # fail on bad state before writing anything
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    _sweep_temporaries(root)
    final = checkpoint_path(run_dir, step)
    tmp = root / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        _write_contents(tmp, model, tokenizer, optimizer, scheduler)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _complete_and_publish(tmp, final, state_text, keep_last)
    return final


def _complete_and_publish(tmp: Path, final: Path, state_text: str, keep_last: int | None) -> None:
    """Write trainer_state.json last (a directory without it is incomplete by construction), fsync, rename
    into place, point `latest` at it, prune; a failure removes the temporary and leaves `latest` as it was."""
    try:
        (tmp / TRAINER_STATE_FILE).write_text(state_text, encoding="utf-8")
        _fsync_tree(tmp)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(final.parent / LATEST_FILE, final.name + "\n")
    if keep_last is not None:
        _prune(final.parent, keep_last, protect=final)


def _sharded(model: Any) -> bool:
    from cohort.distributed import dcp  # imported here: dcp imports this module

    return dcp.is_sharded(model)


def _save_sharded(run_dir: str | os.PathLike, step: int, model: Any, tokenizer: Any, optimizer: Any,
                  scheduler: Any, trainer_state: Mapping[str, Any], keep_last: int | None) -> Path:
    """The collective save of an FSDP2-sharded model; see the module docstring for what it writes.

    Every rank runs the same collectives in the same order: a broadcast (the temporary directory), DCP's
    save, the gathers of the Hugging Face export, an all-gather of each rank's outcome, a broadcast of rank
    0's outcome. A step that fails raises on every rank, and nothing outside the hidden temporary directory
    changes until every rank has written its part.
    """
    from cohort.distributed import dcp

    rank = dist.get_rank()
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = checkpoint_path(run_dir, step)

    # 1. Rank 0 checks the trainer state (before anything is written) and creates the temporary directory.
    def start() -> tuple[str, str]:
        text = _trainer_state_json(step, trainer_state)
        root.mkdir(parents=True, exist_ok=True)
        _sweep_temporaries(root)
        tmp = root / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp.name, text

    tmp_name, state_text = _on_rank0(rank, f"checkpoint step {step}: starting the save", start)
    tmp = root / tmp_name
    # 2. Every rank writes its shards. DCP shares each rank's outcome before returning, so a failure on one
    #    rank raises on all of them here, and no rank runs ahead into the next collective.
    try:
        dcp.save_sharded_state(tmp, model, optimizer)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    # 3. The export's gathers (collective), then the files one rank writes alone. Their failures are caught
    #    so that every rank reaches the exchange of outcomes, which also serves as the barrier.
    error = None
    try:
        dcp.export_hf(tmp, model)
        _write_rank_files(tmp, rank, tokenizer, scheduler)
    except BaseException as e:
        error = e
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}")
    failed = {r: msg for r, msg in enumerate(outcomes) if msg is not None}
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"checkpoint step {step} was not saved: rank(s) failed writing it: {failed}")

    # 4. Rank 0 completes the directory (trainer_state.json last: without it a directory is incomplete),
    #    moves it into place, points `latest` at it and prunes; every rank waits for its outcome.
    _on_rank0(rank, f"checkpoint step {step}: putting it in place",
              lambda: _complete_and_publish(tmp, final, state_text, keep_last))
    return final


def _on_rank0(rank: int, what: str, fn: Any) -> Any:
    """Run `fn` on rank 0 alone and broadcast its result; when it fails, raise on every rank (the original
    exception on rank 0, a CheckpointError naming it elsewhere), so no rank is left waiting."""
    shared: list[Any] = [None, None]  # [result, rank 0's error]
    error = None
    if rank == 0:
        try:
            shared[0] = fn()
        except BaseException as e:
            error, shared[1] = e, f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        if error is not None:
            raise error
        raise CheckpointError(f"{what} failed on rank 0: {shared[1]}")
    return shared[0]


def _write_rank_files(tmp: Path, rank: int, tokenizer: Any, scheduler: Any) -> None:
    """Each rank's RNG state; rank 0 also writes the tokenizer and the scheduler (the same on every rank)."""
    rng_file = tmp / (RNG_FILE if rank == 0 else _rank_rng_file(rank))
    torch.save(_rng_state(), rng_file)
    _fsync_file(rng_file)  # rank 0 fsyncs the whole tree later; the other ranks flush their own file
    if rank == 0:
        shutil.copyfile(rng_file, tmp / _rank_rng_file(0))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)


def _rank_rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


def _trainer_state_json(step: int, trainer_state: Mapping[str, Any]) -> str:
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


def _write_contents(directory: Path, model: Any, tokenizer: Any, optimizer: Any, scheduler: Any) -> None:
    _unwrap(model).save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    if scheduler is not None:
        torch.save(scheduler.state_dict(), directory / SCHEDULER_FILE)
    torch.save(_rng_state(), directory / RNG_FILE)


def _unwrap(model: Any) -> Any:
    """The module that owns `save_pretrained`: strips torch.compile's and DDP's wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def _fsync_tree(directory: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            _fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def _fsync_file(file: str | os.PathLike) -> None:
    with open(file, "rb") as f:
        os.fsync(f.fileno())


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved aside first."""
    old = None
    if final.exists():
        # A directory rename cannot replace a non-empty directory, so park the old one under a hidden name.
        old = final.with_name(f"{_TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _sweep_temporaries(root: Path) -> None:
    """Delete temporaries left by a save that crashed (one process writes a run's checkpoints at a time)."""
    for entry in root.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / TRAINER_STATE_FILE).is_file():
                found.append((int(match.group(1)), entry))
    return sorted(found)


def _prune(root: Path, keep_last: int, protect: Path) -> None:
    checkpoints = _complete_checkpoints(root)
    for _step, path in checkpoints[: max(0, len(checkpoints) - keep_last)]:
        if path != protect:
            shutil.rmtree(path, ignore_errors=True)


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
    elif not has_optimizer_state(path):
        text += " (weights only: run.save_only_model)"
    return text


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def has_optimizer_state(path: str | os.PathLike) -> bool:
    """Whether a checkpoint holds optimizer state (not when saved with run.save_only_model)."""
    path = Path(path)
    if (path / OPTIMIZER_FILE).is_file():
        return True
    from cohort.distributed import dcp

    if dcp.has_sharded_state(path):
        return any(k.startswith("optim.") for k in dcp._saved_keys(path / dcp.DCP_DIR))
    return False


# ------------------------------------------------------------------------------------------------ find
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
        if _STEP_DIR.match(name) and (candidate / TRAINER_STATE_FILE).is_file():
            return candidate
    checkpoints = _complete_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


# ------------------------------------------------------------------------------------------------ load
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
    """
    path = Path(path)
    state_file = path / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise ConfigError(
            f"{str(path)!r} is not a complete cohort checkpoint (no {TRAINER_STATE_FILE}); pass a "
            f"checkpoints/step-NNNNNN directory, or a run directory to `latest_checkpoint` first"
        )
    from cohort.distributed import dcp

    if dcp.has_sharded_state(path):
        dcp.load_sharded_state(path, model, optimizer)
    elif dcp.is_sharded(model):
        if optimizer is not None:  # refuse before touching the model: no half-loaded state
            _refuse_unsharded_optimizer(path)
        dcp.load_full_weights(path, model, _read_full_weights)
    else:
        _load_model_weights(path, _unwrap(model))
        if optimizer is not None:
            optimizer.load_state_dict(_torch_load(path / OPTIMIZER_FILE, map_location, "optimizer"))
    if scheduler is not None:
        scheduler.load_state_dict(_torch_load(path / SCHEDULER_FILE, map_location, "scheduler"))
    if restore_rng:
        _set_rng_state(_torch_load(_rng_file(path, dcp.rank()), "cpu", "RNG"))
    try:
        return json.loads(state_file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise _damaged(state_file, e) from e


def _rng_file(path: Path, rank: int) -> Path:
    """This rank's RNG file; rank 0's rng.pt where the checkpoint has none for it (saved on fewer ranks, or
    unsharded)."""
    own = path / _rank_rng_file(rank)
    return own if own.is_file() else path / RNG_FILE


def _refuse_unsharded_optimizer(path: Path) -> None:
    if not (path / OPTIMIZER_FILE).is_file():
        _torch_load(path / OPTIMIZER_FILE, "cpu", "optimizer")  # raises: saved without one
    raise CheckpointError(
        f"checkpoint {str(path)!r} was saved unsharded: its {OPTIMIZER_FILE} holds whole-tensor optimizer "
        "states keyed by parameter position, which cannot be converted into this FSDP-sharded optimizer. "
        "Either load the weights alone (load_checkpoint(..., optimizer=None): the optimizer starts afresh, "
        "Adam's moments from zero), or resume this checkpoint without sharding (train.sharding unset) and "
        "switch to sharding at a later run"
    )


def _read_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """An unsharded checkpoint's weights: the PEFT adapter (PEFT's key names) or the whole model."""
    adapter = path / "adapter_model.safetensors"
    return _load_safetensors(adapter) if adapter.is_file() else _read_safetensors(path)


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
        raise _damaged(file, e) from e


def _damaged(file: Path, e: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {str(file)!r} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        "): it is truncated or damaged (a copy cut short, a full disk). Resume from an earlier checkpoint "
        "(run.resume=<path to checkpoints/step-NNNNNN>) or delete this checkpoint folder"
    )


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except Exception as e:  # SafetensorError (truncated header or data), OSError
        raise _damaged(file, e) from e


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(_load_safetensors(path / shard))
        return state
    single = path / "model.safetensors"
    if single.is_file():
        return _load_safetensors(single)
    raise CheckpointError(f"checkpoint {str(path)!r} has no model.safetensors (nor a sharded index)")


def _load_model_weights(path: Path, model: Any) -> None:
    if (path / "adapter_model.safetensors").is_file():
        _load_adapter_weights(path, model)
        return
    saved = _read_safetensors(path)
    missing, unexpected = model.load_state_dict(saved, strict=False)
    # save_pretrained drops tied weights (lm_head sharing the embedding); those are filled by their twin.
    tied = _aliased_keys(model, set(saved))
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the model ({type(model).__name__}): missing keys "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}; load it into the architecture it was saved from"
        )


def _aliased_keys(model: torch.nn.Module, loaded: set[str]) -> set[str]:
    """State-dict keys that share storage with a loaded key (tied weights)."""
    state = model.state_dict(keep_vars=True)
    loaded_ptrs = {state[k].data_ptr() for k in loaded if k in state}
    return {k for k, v in state.items() if k not in loaded and v.data_ptr() in loaded_ptrs}


def _load_adapter_weights(path: Path, model: Any) -> None:
    try:
        from peft import set_peft_model_state_dict
    except ImportError as e:
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds a PEFT adapter but `peft` is not installed: pip install peft"
        ) from e
    result = set_peft_model_state_dict(model, _load_safetensors(path / "adapter_model.safetensors"))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise CheckpointError(
            f"adapter in {str(path)!r} does not fit the model: unexpected keys {unexpected[:5]}"
        )


# ------------------------------------------------------------------------------------------------- RNG
def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        # NumPy's key array is stored as a tensor so that the file loads with torch's safe loader.
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        # Restore as many devices as both the saving and the loading machine have.
        for device, cuda_state in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)

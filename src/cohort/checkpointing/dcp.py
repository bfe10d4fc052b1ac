"""Sharded checkpoints of FSDP2 policies through torch.distributed.checkpoint (DCP).

`cohort.checkpointing` owns the checkpoint layout and its atomic save protocol; this module holds the parts that
are collective over the ranks of an FSDP2-sharded (`fully_shard`) policy:

- `is_sharded`: whether a policy is FSDP2-sharded (then saving and loading are collective);
- `save_sharded_state`: every rank writes its shards of the policy and optimizer state into `<dir>/dcp/`;
- `export_hf`: gathers the whole policy onto rank 0, which writes the Hugging Face folder (for a PEFT model
  the adapter only, exactly what an unsharded save writes);
- `load_sharded_state`: reads `<dir>/dcp/` into the live policy and optimizer on any number of ranks (DCP
  reshards: saved on 2 ranks, loaded on 1 or 4);
- `load_full_weights`: loads the whole-tensor weights of an unsharded checkpoint into a sharded policy.

Every function here is called on every rank, with the same arguments and in the same order, because each one
runs collectives on the default process group (the one the trainer created, with its timeout: a rank that
dies mid-save turns into a timeout on the others instead of a hang).

Keys: DCP names tensors by their canonical fully qualified names, without torch.compile's `_orig_mod.` or
activation checkpointing's `_checkpoint_wrapped_module.`, so a checkpoint loads whether or not the live model
is compiled or wrapped. `canonical_name` strips the same prefixes where cohort lists names itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from cohort.checkpointing.dcp_reader import (
    OPTIM_KEY,
    OPTIMIZER_PREFIX,
    SafeLoadPlanner,
    SafeReader,
    read_metadata,
)
from cohort.checkpointing.errors import CheckpointError
from cohort.checkpointing.weights import unwrap_model

DCP_DIR = "dcp"
_MODEL_KEY = "model"
_OPTIM_KEY = OPTIM_KEY
# Module names that wrappers insert into parameter names and that no Hugging Face model uses itself.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model` or any submodule is FSDP2-sharded (`torch.distributed.fsdp.fully_shard`)."""
    return any(isinstance(module, FSDPModule) for module in model.modules())


def rank() -> int:
    """This process's rank in the default group; 0 without one (a single process)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def canonical_name(name: str) -> str:
    """A parameter name without torch.compile's, activation checkpointing's or FSDP1's wrapper segments."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel  # optional dependency (the peft extra: LoRA)
    except ImportError:
        return False
    return isinstance(unwrap_model(model), PeftModel)


def _options(model: Any, **kwargs: Any) -> StateDictOptions:
    # A PEFT checkpoint holds what training changes, the adapter, as an unsharded PEFT save does: the frozen
    # base comes from the pretrained model on every load, so it is not copied into every checkpoint.
    return StateDictOptions(ignore_frozen_params=is_peft(model), **kwargs)


def _drop_frozen(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Complete `ignore_frozen_params`: DCP drops frozen parameters by their first name only, so a frozen
    tied LM head (a LoRA model of SmolLM2) would stay under its second name, a copy of the embedding."""
    if is_peft(model):
        for name, param in model.named_parameters(remove_duplicate=False):
            if not param.requires_grad:
                state.pop(canonical_name(name), None)
    return state


def _live_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The state DCP saves and loads, sharded as the live model is: {"model": ..., "optim": ...}."""
    options = _options(model)
    if optimizer is None:
        return {_MODEL_KEY: _drop_frozen(model, get_model_state_dict(model, options=options))}
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {_MODEL_KEY: _drop_frozen(model, model_state), _OPTIM_KEY: optim_state}


# ------------------------------------------------------------------------------------------------ save
def save_sharded_state(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank writes its shards of the model (and optimizer) state into `directory/dcp/`.

    DCP gathers each rank's outcome before it returns, so a failure on any rank raises on every rank (as a
    CheckpointError naming the failed ranks) and no rank goes on to the next collective alone.
    """
    state = _live_state(model, optimizer)
    try:
        dcp.save(state, checkpoint_id=directory / DCP_DIR)
    except CheckpointException as e:
        raise CheckpointError(f"writing the sharded state into {str(directory)!r} failed: {_failures(e)}") from e


def _failures(e: CheckpointException) -> str:
    """DCP's exception (a BaseException, which `except Exception` would miss) as one line per failed rank."""
    return "; ".join(f"rank {r}: {type(exc).__name__}: {exc}" for r, (exc, _trace) in sorted(e.failures.items()))


def export_hf(directory: Path, model: torch.nn.Module) -> None:
    """Gather the whole policy onto rank 0's CPU; rank 0 writes it as a Hugging Face folder into `directory`.

    Collective (every rank takes part in the gathers); only rank 0 writes. A PEFT model gathers and writes its
    adapter only (adapter_model.safetensors + adapter_config.json, PEFT's key names), as an unsharded save does.
    """
    full = _drop_frozen(model, get_model_state_dict(model, options=_options(model, full_state_dict=True,
                                                                            cpu_offload=True)))
    if rank() != 0:
        return
    # DCP's names are canonical already; stripping again guards against a wrapper it does not know.
    full = {canonical_name(k): v for k, v in full.items()}
    # Tied weights arrive as separate copies, which save_pretrained would both write; drop the twins as an
    # unsharded save does (lm_head.weight when it is the embedding), from_pretrained ties them again.
    for name, first in _first_names(model).items():
        if name != first and first in full:
            full.pop(name, None)
    if not is_peft(model):
        full = _in_config_dtype(unwrap_model(model), full)
    # PeftModel.save_pretrained passes `state_dict` through get_peft_model_state_dict (which keeps the adapter
    # and drops the adapter name from its keys); a transformers model writes the dict as given.
    unwrap_model(model).save_pretrained(directory, state_dict=full, safe_serialization=True)


def _in_config_dtype(model: Any, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights in the dtype the model declares (config.dtype), as an unsharded save writes them.

    Sharding upcasts trainable parameters to float32 master weights (the unsharded path keeps those in the
    optimizer instead), so a bf16 model would otherwise be exported at twice its size.
    """
    dtype = getattr(getattr(model, "config", None), "dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        return full
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}


# ------------------------------------------------------------------------------------------------ load
def has_sharded_state(path: Path) -> bool:
    return (path / DCP_DIR).is_dir()


def load_sharded_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read `path/dcp/` into the live model (and optimizer) in place, on any number of ranks.

    The live model may be sharded over a different number of ranks than the saving one (DCP reads each
    rank's slice of every tensor from whichever files hold it), or not sharded at all (a single process,
    e.g. to evaluate). Optimizer states (Adam's step, exp_avg, exp_avg_sq) are restored exactly.

    Call it on a checkpoint whose files were verified against its manifest (`load_checkpoint` does). DCP's
    metadata and the non-tensor values are unpickled by `dcp_reader`'s restricted readers, never by DCP's own.
    """
    directory = path / DCP_DIR
    saved = _saved_keys(directory)
    if optimizer is not None and not any(k.startswith(OPTIMIZER_PREFIX) for k in saved):
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved without optimizer state, so it cannot be restored; "
            "pass optimizer=None to load_checkpoint to load the weights alone"
        )
    # A fresh optimizer has no state yet; get_state_dict creates it (a zero-learning-rate step) so that DCP
    # has tensors of the right shards to read into.
    state = _live_state(model, optimizer)
    _check_model_keys(path, model, set(state[_MODEL_KEY]), saved)
    try:
        dcp.load(state, storage_reader=SafeReader(directory), planner=SafeLoadPlanner())
    except CheckpointException as e:
        damaged = _damaged_files(directory)
        named = (f"damaged file(s): {'; '.join(damaged)}: they are truncated or damaged (a copy cut short, a full "
                 "disk); resume from an earlier checkpoint or delete this one. " if damaged else "")
        raise CheckpointError(f"checkpoint {str(path)!r}: reading its sharded state failed: {named}"
                              f"{_failures(e)}") from e
    # strict=False: the keys were checked above, and a PEFT state leaves out the frozen base on purpose.
    options = _options(model, strict=False)
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state[_MODEL_KEY],
                       optim_state_dict=state[_OPTIM_KEY], options=options)
    else:
        set_model_state_dict(model, state[_MODEL_KEY], options=options)


def _damaged_files(directory: Path) -> list[str]:
    """The shard files of a DCP checkpoint that are missing or shorter than its metadata says."""
    try:
        storage = read_metadata(directory).storage_data or {}
    except Exception:  # unreadable metadata is reported by _saved_keys
        return []
    needed: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if name:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    damaged = []
    for name, size in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            damaged.append(f"{str(file)!r} is missing")
        elif file.stat().st_size < size:
            damaged.append(f"{str(file)!r} has {file.stat().st_size} bytes of {size}")
    return damaged


def _saved_keys(directory: Path) -> set[str]:
    """The flattened keys (`model.<fqn>`, `optim.state.<fqn>.exp_avg`, ...) a DCP checkpoint holds."""
    try:
        metadata = read_metadata(directory)
    except Exception as e:  # OSError, a truncated pickle, one refused by the restricted unpickler
        raise CheckpointError(
            f"sharded checkpoint {str(directory)!r} has no readable .metadata ({type(e).__name__}: {e}); it is "
            "incomplete or damaged: resume from another checkpoint or start over"
        ) from e
    return set(metadata.state_dict_metadata)


def _check_model_keys(path: Path, model: Any, live: set[str], saved_flat: set[str]) -> None:
    prefix = _MODEL_KEY + "."
    saved = {k[len(prefix):] for k in saved_flat if k.startswith(prefix)}
    missing, unexpected = sorted(live - saved), sorted(saved - live)
    if missing or unexpected:
        raise CheckpointError(
            f"sharded checkpoint {str(path)!r} does not fit the model ({type(unwrap_model(model)).__name__}): keys "
            f"missing from it {missing[:5]}{'...' if len(missing) > 5 else ''}, keys the model lacks "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; load it into the architecture (and LoRA "
            "settings) it was saved from"
        )


def load_full_weights(path: Path, model: torch.nn.Module, read_full: Any) -> None:
    """Load an unsharded checkpoint's weights (whole tensors) into a sharded model, on every rank.

    `read_full(path)` returns the checkpoint's state dict; only rank 0 calls it, and its tensors are
    broadcast, so the other ranks never hold the whole model. A PEFT adapter's keys are mapped onto the live
    model's names first. Rank 0 checks the keys and tells every rank the verdict, so all raise or none does.
    """
    live = _drop_frozen(model, get_model_state_dict(model, options=_options(model)))
    full: dict[str, Any] = {}  # tensors; typed as set_model_state_dict's (invariant) dict of state values
    verdict: list[str | None] = [None]
    error: Exception | None = None
    if rank() == 0:
        try:
            full = _to_model_names(path, model, read_full(path), live)
            _check_full_keys(path, model, set(full), set(live))
        except Exception as e:  # any failure: the other ranks must hear of it, not wait in the broadcast
            error, verdict = e, [str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"]
    if dist.is_initialized():
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0]) from error
    set_model_state_dict(model, full, options=_options(model, full_state_dict=True,
                                                       broadcast_from_rank0=dist.is_initialized(),
                                                       strict=False))


def _to_model_names(path: Path, model: Any, saved: dict[str, torch.Tensor],
                    live: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Key a saved state dict by the live model's canonical names (a PEFT adapter file uses PEFT's names)."""
    if not is_peft(model):
        return {canonical_name(k): v for k, v in saved.items()}
    from peft import get_peft_model_state_dict  # optional dependency (the peft extra: LoRA)

    # get_peft_model_state_dict renames without copying, so the identity of each value maps a PEFT name
    # back to the model's name; this follows whatever renaming PEFT applies (adapter names, modules_to_save).
    peft_view = get_peft_model_state_dict(unwrap_model(model), state_dict=live)
    model_name = {id(v): k for k, v in live.items()}
    to_model = {peft_key: model_name[id(v)] for peft_key, v in peft_view.items() if id(v) in model_name}
    unknown = sorted(set(saved) - set(to_model))
    if unknown:
        raise CheckpointError(f"adapter in {str(path)!r} does not fit the model: unexpected keys {unknown[:5]}")
    return {to_model[k]: v for k, v in saved.items()}


def _check_full_keys(path: Path, model: torch.nn.Module, saved: set[str], live: set[str]) -> None:
    # save_pretrained drops tied weights (lm_head sharing the embedding); their twin fills them.
    tied = _tied_names(model, saved)
    missing = sorted(k for k in live - saved if k not in tied)
    unexpected = sorted(saved - live)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the model ({type(unwrap_model(model)).__name__}): missing keys "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}; load it into the architecture it was saved from"
        )


def _first_names(model: torch.nn.Module) -> dict[str, str]:
    """Each canonical parameter name -> the first name of the same parameter (itself unless tied)."""
    first: dict[int, str] = {}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        out[canonical_name(name)] = first.setdefault(id(param), canonical_name(name))
    return out


def _tied_names(model: torch.nn.Module, loaded: set[str]) -> set[str]:
    """Canonical names of parameters that are the same object as a loaded one (tied weights)."""
    groups: dict[str, set[str]] = {}
    for name, first in _first_names(model).items():
        groups.setdefault(first, set()).add(name)
    return {n for group in groups.values() if group & loaded for n in group - loaded}

"""The policy's weights in a checkpoint's Hugging Face files: reaching the model that owns `save_pretrained`,
and reading safetensors (whole model, sharded index, or PEFT adapter) back into a live, unsharded model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from cohort.checkpointing.errors import CheckpointError, damaged


def unwrap_model(model: Any) -> Any:
    """The module that owns `save_pretrained`: strips torch.compile's and DDP's wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def read_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """An unsharded checkpoint's weights: the PEFT adapter (PEFT's key names) or the whole model."""
    adapter = path / "adapter_model.safetensors"
    return _load_safetensors(adapter) if adapter.is_file() else _read_safetensors(path)


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(file)
    except Exception as e:  # SafetensorError (truncated header or data), OSError
        raise damaged(file, e) from e


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


def load_model_weights(path: Path, model: Any) -> None:
    """Copy the checkpoint's weights (or PEFT adapter) into `model` in place; a CheckpointError when they do
    not fit it."""
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
        from peft import set_peft_model_state_dict  # optional dependency (the peft extra: LoRA)
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

"""What a model's config says about lengths and the rollout engine's KV cache, known before any weight loads.

- `model_context(config)`: the longest prompt + completion the model was built for and the field that says
  so: max_position_embeddings (read through the text config of a vision-language model such as Gemma 3's
  Gemma3Config; GPT-2-style configs map n_positions onto it), else max_sequence_length / seq_length. A
  sliding window (Mistral, Gemma 3's local layers, Qwen's use_sliding_window) limits what one layer attends
  to, not the context: the global layers still see max_position_embeddings positions.
- `kv_bytes_per_token(config, dtype_bytes)` and `kv_pool_tokens(...)`: the arithmetic of the engine's paged
  KV pool (engine/model_runner.py sizes it the same way: `int(free * fraction) // bytes_per_block` blocks),
  so a length can be checked against memory before the model loads.
- `peek_config(name_or_path)`: the model's config from its config.json alone (a local folder or a hub id in
  the local cache); None where reading it would mean converting a GGUF file or downloading, so the checks
  that need it run after the load instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig

# The share of kv_cache_fraction taken on the CPU is of this many bytes (there is no free-memory query there).
CPU_KV_BUDGET = 4 << 30
# Config fields that give a model's context, in the order they are trusted.
_CONTEXT_FIELDS = ("max_position_embeddings", "max_sequence_length", "seq_length")


def text_config(config: Any) -> Any:
    """The language model's config (a vision-language model nests it), or `config` itself."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def model_context(config: Any) -> tuple[int | None, str]:
    """(the model's context in tokens, the config field it comes from); (None, "") when the config names none."""
    text = text_config(config)
    for name in _CONTEXT_FIELDS:
        value = text.get(name) if isinstance(text, dict) else getattr(text, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, name
    return None, ""


def default_block_size(device_type: str) -> int:
    """Tokens per KV block when the engine is not told (CohortEngine's block_size=None)."""
    return 64 if device_type == "cuda" else 16


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """K and V of one token over every layer, in bytes (the engine's cache keeps every layer's, windowed or not)."""
    text = text_config(config)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * dtype_bytes


def kv_pool_tokens(free_bytes: int, fraction: float, bytes_per_token: int, block_size: int) -> int:
    """Tokens the engine's KV pool holds when it takes `fraction` of `free_bytes`: whole blocks only."""
    return int(free_bytes * fraction) // (bytes_per_token * block_size) * block_size


def largest_fitting(fits, high: int, low: int = 1) -> int | None:
    """The largest value in [low, high] for which `fits(value)` holds, for a `fits` that holds up to some value
    and not beyond (binary search); None when even `low` does not fit."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def peek_config(name_or_path: str, *, gguf_file: str | None = None, trust_remote_code: bool = False):
    """The model's config read from config.json without loading weights, or None when that is not possible
    without more work (a GGUF source, a named offline model, a hub id that is not in the local cache)."""
    name = str(name_or_path)
    if gguf_file is not None or name.lower().endswith(".gguf"):
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        folder = path if (path / "config.json").is_file() else None
    elif not path.exists() and name.count("/") == 1 and not name.startswith((".", "/", "~")):
        cached = try_to_load_from_cache(name, "config.json")
        folder = Path(os.path.dirname(cached)) if isinstance(cached, str) else None
    else:
        folder = None
    if folder is None:
        return None
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError):  # an unreadable or unknown config: the load will say why
        return None

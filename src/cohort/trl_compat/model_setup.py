"""The model and tokenizer side of `GRPOTrainer`'s build: loading a model given by name (an alias such as
`smollm2-135m-instruct` resolved locally before anything could reach the Hub), model_init_kwargs onto
cohort's model config, disable_dropout on the policy, and the tools' schemas the prompts are rendered with
(after checking that the chat template can render tools).
"""

from __future__ import annotations

import torch

from cohort.agents.templates import apply_chat_template_override, check_renders_tools
from cohort.agents.tools import build_tools
from cohort.errors import ConfigError
from cohort.policy.model import load_policy, resolve_model_path
from cohort.setup import resolve_device, resolve_dtype
from cohort.setup.rewards import build_environments
from cohort.vision.model import is_vision_checkpoint, load_vision_policy

_MODEL_INIT_KEYS = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
                    "trust_remote_code": "trust_remote_code"}


def load_named_model(name: str, cfg):
    """GRPOTrainer(model="<name>"): (model, tokenizer or a VLM's processor) on cfg.train.device.

    The name is resolved first (`resolve_model_path`): an alias (smollm2-135m-instruct, gemma-3-270m), a .gguf
    or a folder becomes a local folder without any network call, and only then is its config read to tell a
    vision-language model from a text one. Asked the other way round, transformers would look the alias up on
    the Hub first (five tries, about 25 s, when the network is unreachable and HF_HUB_OFFLINE is unset)."""
    device = resolve_device(cfg.train.device)
    path = resolve_model_path(name, gguf_file=cfg.model.gguf_file)
    load = load_vision_policy if is_vision_checkpoint(path) else load_policy  # a VLM: its processor
    return load(path, dtype=resolve_dtype(cfg.model.dtype, device), device=device,
                trust_remote_code=cfg.model.trust_remote_code, attn_implementation=cfg.model.attn_implementation)


def tool_schemas(cfg, tok) -> list | None:
    """tools= / environment_factory=: the tools' schemas the prompts are rendered with, after the chat template
    (GRPOConfig(extra={'model.chat_template': 'chatml_tools'}), else the tokenizer's own) is checked to render
    tools (a ConfigError naming model.chat_template=chatml_tools when it cannot)."""
    a = cfg.agent
    if not a.tools and a.environment_factory is None:
        return None
    if cfg.model.chat_template:
        apply_chat_template_override(tok, cfg.model.chat_template)
    check_renders_tools(tok)
    if a.environment_factory is not None:
        return [t.schema for t in build_environments(cfg).all_tools]
    return [t.schema for t in build_tools(list(a.tools))]


def apply_model_init_kwargs(kwargs: dict | None, cfg) -> None:
    """GRPOConfig(model_init_kwargs=...) onto cfg.model: the keys cohort's loader takes; others raise ConfigError."""
    for key, value in (kwargs or {}).items():
        if value is None or (key == "revision" and value == "main"):  # TRL's scripts pass their defaults
            continue
        if key == "revision":
            raise ConfigError(f"GRPOConfig(model_init_kwargs={{'revision': {value!r}}}) is not supported by cohort: "
                              "download that revision (huggingface-cli download --revision) and pass its folder.")
        if key not in _MODEL_INIT_KEYS:
            raise ConfigError(f"GRPOConfig(model_init_kwargs={{{key!r}: ...}}) is not supported by cohort: it takes "
                              f"{', '.join(sorted(_MODEL_INIT_KEYS))}.")
        if _MODEL_INIT_KEYS[key] == "dtype":
            value = str(value).removeprefix("torch.")
        setattr(cfg.model, _MODEL_INIT_KEYS[key], value)


def disable_dropout(model) -> None:
    """GRPOConfig(disable_dropout=True): every Dropout of the policy at p=0, as TRL does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

"""What cohort needs to know about a vision-language model: is it one, where its parts are, how to load it.

A Hugging Face VLM (Qwen2-VL, Qwen2.5-VL, Idefics3/SmolVLM, ...) is `<ForConditionalGeneration>` holding an
inner `.model` with a vision tower (`visual`, `vision_model`, plus a projector such as `connector`) and a
language model (`language_model` or `text_model`), and an `lm_head` outside. cohort's training forward and
rollout engine call the inner model's own `get_image_features` and drive the language model directly, so
they need these handles; peft's LoRA wrapper is looked through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from cohort.errors import ConfigError
from cohort.policy.model import _from_pretrained, _with_pad_token
from cohort.policy.model import resolve_dtype as model_dtype

if TYPE_CHECKING:  # a Hugging Face module reached by attribute name (see cohort.engine.models.decoder)
    from cohort.engine.models.decoder import HFModule

_LANGUAGE_NAMES = ("language_model", "text_model")


def is_vision_config(config: Any) -> bool:
    """A config with a `vision_config` (every transformers VLM has one)."""
    return getattr(config, "vision_config", None) is not None


def unwrap(model: torch.nn.Module) -> HFModule:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_vision_model(model: torch.nn.Module) -> bool:
    return is_vision_config(getattr(unwrap(model), "config", None))


def inner_model(model: torch.nn.Module) -> HFModule:
    """The `<Family>Model` inside `<Family>ForConditionalGeneration` (it owns get_image_features)."""
    base = unwrap(model)
    inner = getattr(base, "model", None)
    if inner is None or not hasattr(inner, "get_image_features"):
        raise ConfigError(f"{type(base).__name__} is not a vision-language model cohort can drive: it has no "
                          "`.model.get_image_features` (supported: Qwen2-VL, Qwen2.5-VL, Idefics3/SmolVLM and other "
                          "transformers *ForConditionalGeneration VLMs with that layout)")
    return inner


def language_model(model: torch.nn.Module) -> HFModule:
    """The text decoder body (embeddings, layers, final norm; no LM head)."""
    inner = inner_model(model)
    for name in _LANGUAGE_NAMES:
        body = getattr(inner, name, None)
        if body is not None:
            return body
    raise ConfigError(f"{type(inner).__name__}: cannot find its language model (looked for {_LANGUAGE_NAMES})")


def language_prefix(model: torch.nn.Module) -> str:
    """The dotted name of the language model inside `model` (as named_modules spells it)."""
    body = language_model(model)
    for name, module in model.named_modules():
        if module is body:
            return name
    raise ConfigError("the language model is not a submodule of the policy")


def vision_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Every parameter of the inner model outside the language model: the vision tower and its projector."""
    inner, body = inner_model(model), language_model(model)
    text = {id(p) for p in body.parameters()}
    return [(n, p) for n, p in inner.named_parameters() if id(p) not in text]


def freeze_vision(model: torch.nn.Module) -> int:
    """Stop gradients into the vision tower and projector (model.freeze_vision); returns how many tensors."""
    params = vision_parameters(model)
    for _, p in params:
        p.requires_grad_(False)
    return len(params)


def lora_target_modules(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Full names of the language model's modules whose last name part is in `names` (q_proj, ...). peft
    matches a bare name anywhere, and Idefics3's vision tower has q_proj too: listing full names keeps the
    adapters on the language side."""
    prefix = language_prefix(model)
    wanted = set(names)
    found = [n for n, _ in model.named_modules() if n.startswith(prefix + ".") and n.rsplit(".", 1)[-1] in wanted]
    if not found:
        raise ConfigError(f"model.lora_target_modules={names}: none of these module names exist in the language "
                          f"model ({prefix}); use names of its linear layers, e.g. q_proj, v_proj")
    return found


def image_token_id(model: torch.nn.Module) -> int:
    """The placeholder token the processor repeats once per image feature."""
    config = unwrap(model).config
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    raise ConfigError(f"{type(unwrap(model)).__name__}: its config names no image token (image_token_id)")


def uses_mrope(model: torch.nn.Module) -> bool:
    """Qwen2-VL-style multimodal RoPE: positions come from the model's get_rope_index, 3 per token."""
    return hasattr(inner_model(model), "get_rope_index")


def load_vision_policy(path: str, *, dtype: Any = "auto", device: Any = None, trust_remote_code: bool = False,
                       attn_implementation: str | None = None):
    """A VLM and its processor -> (model, processor). The processor's tokenizer gets a pad token."""
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    processor = _from_pretrained(AutoProcessor, path, "processor", **kwargs)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"model name_or_path={path!r}: AutoProcessor gave a {type(processor).__name__} without a "
                          "tokenizer and an image processor; a vision-language model folder needs both "
                          "(processor_config.json / preprocessor_config.json beside the tokenizer files). If they are "
                          "there, a missing dependency is the likely cause: transformers 5 builds Qwen2-VL's processor "
                          "with a video processor that needs torchvision (pip install torchvision)")
    _with_pad_token(processor.tokenizer)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = _from_pretrained(AutoModelForImageTextToText, path, "model", dtype=model_dtype(dtype), **kwargs)
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = processor.tokenizer.pad_token_id
    if device is not None:
        model.to(device)
    return model, processor


def is_vision_checkpoint(path: str) -> bool:
    """Whether the config at `path` (a folder or hub id in the local cache) describes a VLM; False when it
    cannot be read (the ordinary loader then reports the problem)."""
    try:
        return is_vision_config(AutoConfig.from_pretrained(path))
    except Exception:  # missing folder, offline hub, GGUF: the text loader's errors are the right ones
        return False

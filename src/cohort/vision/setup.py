"""How `cohort.setup.build_components` handles vision-language models (it calls these; each is a no-op for
text models):

- `load_model`: a checkpoint whose config has a `vision_config` loads with AutoModelForImageTextToText and
  AutoProcessor; the processor's tokenizer is the run's tokenizer (decoding, EOS, checkpoints).
- `split_processor`: a processor handed in (TRL's `processing_class=AutoProcessor...`) splits into
  (tokenizer, processor).
- `prepare_policy`: model.freeze_vision stops gradients into the vision tower and projector; LoRA targets are
  resolved to the language model's modules only (the vision tower stays frozen, as peft freezes every
  non-adapter weight).
- `encode_dataset`: image rows go through the processor (`encode_vision_dataset`); an image column on a
  text-only model, or on a VLM without its processor, is a DataError naming the row and the fix.
- `build_engine`: VLM rollouts run on cohort's paged engine where it supports the family (Qwen2-VL,
  Qwen2.5-VL, Idefics3/SmolVLM: engine/models/vision_decoder.py), else on `VisionGroupEngine` (the model's HF
  modules, one vision pass and one prefill per group), and the log says why.
"""

from __future__ import annotations

from typing import Any

from cohort.engine import engine_supports
from cohort.errors import ConfigError, DataError
from cohort.policy.model import resolve_model_path
from cohort.vision.engine import VisionGroupEngine
from cohort.vision.inputs import check_text_model_data, encode_vision_dataset, has_image_column
from cohort.vision.model import (
    freeze_vision,
    image_token_id,
    is_vision_checkpoint,
    is_vision_model,
    load_vision_policy,
    lora_target_modules,
)


def split_processor(obj: Any) -> tuple[Any, Any]:
    """(tokenizer, processor or None) from a tokenizer or a multimodal processor."""
    if obj is not None and getattr(obj, "image_processor", None) is not None and hasattr(obj, "tokenizer"):
        return obj.tokenizer, obj
    return obj, None


def load_model(cfg, *, dtype, device):
    """(policy, tokenizer, processor) for a VLM checkpoint; None when model.name_or_path is not one."""
    m = cfg.model
    path = resolve_model_path(m.name_or_path, gguf_file=m.gguf_file)
    if not is_vision_checkpoint(path):
        return None
    model, processor = load_vision_policy(path, dtype=dtype, device=device, trust_remote_code=m.trust_remote_code,
                                          attn_implementation=m.attn_implementation)
    return model, processor.tokenizer, processor


def check_settings(cfg, policy, hf_generate: bool = False) -> None:
    """Settings that a VLM (or a text model) cannot take, before any work. hf_generate: the rollouts run on
    transformers' generate (generation.engine=hf, or a generate the user replaced), the path that continues a
    conversation with images."""
    vision = is_vision_model(policy)
    if cfg.model.freeze_vision and not vision:
        raise ConfigError(f"model.freeze_vision=true but model {cfg.model.name_or_path!r} is a text-only model (no "
                          "vision tower to freeze); remove the setting")
    if vision and cfg.train.sharding == "fsdp":
        raise ConfigError("train.sharding=fsdp is not supported for vision-language models yet; use "
                          "train.sharding=none (data parallel) or LoRA (model.lora_r) to fit the model")
    if vision and (cfg.agent.tools or cfg.agent.environment_factory is not None) and not hf_generate:
        field = "agent.tools" if cfg.agent.tools else "agent.environment_factory"
        raise ConfigError(f"{field} with a vision-language model runs its multi-turn rollouts on transformers' "
                          "generate (cohort's vision engines do not continue a conversation with images yet); set "
                          f"generation.engine=hf, or remove {field}")


def lora_targets(policy, names: list[str]) -> list[str]:
    """model.lora_target_modules as given for text models; on a VLM, those modules of the language model only."""
    return lora_target_modules(policy, names) if is_vision_model(policy) else list(names)


def prepare_policy(cfg, policy, echo=print) -> None:
    """model.freeze_vision on a VLM trained without LoRA (LoRA already freezes the vision tower)."""
    if cfg.model.freeze_vision and is_vision_model(policy) and cfg.model.lora_r <= 0:
        count = freeze_vision(policy)
        echo(f"model.freeze_vision: {count} vision tower / projector tensors frozen; the language model trains")


def encode_dataset(dataset, tokenizer, processor, policy, max_prompt_length: int | None, truncation: str,
                   chat_template_kwargs: dict | None = None, model_name: str = "the model"):
    """`dataset.encode(...)`, through the processor when the model sees images."""
    images = has_image_column(dataset)
    if policy is not None and is_vision_model(policy):
        if processor is None:
            if images:
                raise DataError(f"Dataset {dataset.source!r} has images but {model_name!r} was given a tokenizer, "
                                "not its processor; pass processing_class=AutoProcessor.from_pretrained(...) (or "
                                "let cohort load the model from model.name_or_path)")
        else:
            return encode_vision_dataset(dataset, processor, max_prompt_length, truncation, chat_template_kwargs,
                                         image_token_id=image_token_id(policy))
    elif images:
        check_text_model_data(dataset, model_name)
    return dataset.encode(tokenizer, max_prompt_length, truncation=truncation,
                          chat_template_kwargs=chat_template_kwargs)


def build_engine(policy, tokenizer, eos_token_ids, echo=print, choice: str = "auto"):
    """The rollout engine of a VLM: None when cohort's paged engine runs it (the caller builds that one, as for
    text models; models/vision_decoder.py), else `VisionGroupEngine`. Never HF `generate` on token ids alone:
    it would not see the images."""
    if not is_vision_model(policy):
        return None
    ok, why = engine_supports(policy)
    if ok and choice in ("auto", "cohort"):
        return None
    reason = why if not ok else f"generation.engine={choice!r}"
    echo(f"rollouts: vision group engine on the model's HF modules ({reason}): the vision tower and the prefill "
         "run once per prompt, the G completions decode on copies of its KV")
    return VisionGroupEngine(policy, tokenizer, eos_token_ids=eos_token_ids)

"""The model and tokenizer side of `GRPOTrainer`: what its constructor loads (`load_trainer_models`: the
policy given by name, an alias such as `smollm2-135m-instruct` resolved locally before anything could reach the
Hub; the processing class of a model object; peft_config and disable_dropout applied; the reference copy when
beta != 0), model_init_kwargs onto cohort's model config, and the tools' schemas the prompts are rendered with
(after checking that the chat template can render tools).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import AutoProcessor

from cohort.agents.templates import apply_chat_template_override, check_renders_tools
from cohort.agents.tools import build_tools
from cohort.algorithms import build_policy_loss
from cohort.errors import ConfigError
from cohort.policy.model import load_policy, resolve_model_path
from cohort.policy.quantized import missing_support
from cohort.setup import frozen_copy, resolve_device, resolve_dtype
from cohort.setup.rewards import build_environments
from cohort.vision.model import is_vision_checkpoint, load_vision_policy

_MODEL_INIT_KEYS = {"dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
                    "trust_remote_code": "trust_remote_code"}


def load_named_model(name: str, cfg, quantization: str = "none"):
    """GRPOTrainer(model="<name>"): (model, tokenizer or a VLM's processor) on cfg.train.device.

    The name is resolved first (`resolve_model_path`): an alias (smollm2-135m-instruct, gemma-3-270m), a .gguf
    or a folder becomes a local folder without any network call, and only then is its config read to tell a
    vision-language model from a text one. Asked the other way round, transformers would look the alias up on
    the Hub first (five tries, about 25 s, when the network is unreachable and HF_HUB_OFFLINE is unset)."""
    device = resolve_device(cfg.train.device)
    path = resolve_model_path(name, gguf_file=cfg.model.gguf_file)
    if is_vision_checkpoint(path):  # a VLM: its processor
        if quantization != "none":
            raise ConfigError("GRPOConfig(model_init_kwargs={'quantization_config': ...}): 4-bit vision-language "
                              "models are not supported yet; train LoRA adapters on model.dtype weights")
        return load_vision_policy(path, dtype=resolve_dtype(cfg.model.dtype, device), device=device,
                                  trust_remote_code=cfg.model.trust_remote_code,
                                  attn_implementation=cfg.model.attn_implementation)
    return load_policy(path, dtype=resolve_dtype(cfg.model.dtype, device), device=device,
                       trust_remote_code=cfg.model.trust_remote_code, attn_implementation=cfg.model.attn_implementation,
                       quantization=quantization)


def load_trainer_models(model: Any, processing_class: Any, cfg, *, peft_config: Any = None,
                        dropout_off: bool = False, quantization: str = "none") -> tuple[Any, Any, Any]:
    """What TRL's GRPOTrainer.__init__ builds: (policy, processing class, reference model or None).

    A name loads here (a model needing remote code without model_init_kwargs trust_remote_code=True raises, as
    transformers does); a model object is kept (the same object is trained, read in place by the engine) and,
    without processing_class, gets the processor saved under its config's _name_or_path (TRL's rule). peft_config
    wraps the policy in LoRA adapters, disable_dropout zeroes every Dropout; with beta != 0 the reference is a
    frozen copy of the policy as it stands (cohort's rule, also under LoRA)."""
    if isinstance(model, str | os.PathLike):
        policy, loaded = load_named_model(str(model), cfg, quantization)
        cfg.model.name_or_path = str(model)
        processing_class = processing_class or loaded
    else:
        policy = model
        processing_class = processing_class or _processor_of(model, cfg)
    if peft_config is not None:  # TRL's way to train LoRA adapters
        from peft import get_peft_model  # optional dependency (the peft extra: LoRA)

        check_peft_config(peft_config)
        policy = get_peft_model(policy, peft_config)
        check_lm_head_adapter(policy)
    if dropout_off:
        disable_dropout(policy)
    loss = build_policy_loss(cfg.loss.loss_type, cfg.loss.loss_params())
    reference = frozen_copy(policy) if float(getattr(loss, "beta", 0.0) or 0.0) != 0.0 else None
    return policy, processing_class, reference


def check_peft_config(peft_config: Any) -> None:
    """A prompt-learning method (prompt tuning, prefix tuning, P-tuning) adds virtual tokens in PeftModel.forward,
    which cohort's packed forward does not call: the loss would be computed without them (TRL raises the same
    for its fused Liger loss)."""
    if getattr(peft_config, "is_prompt_learning", False):
        raise ValueError(f"peft_config={type(peft_config).__name__}: prompt-learning methods are not supported by "
                         "cohort (its packed forward calls the base model, so the virtual tokens would be left out); "
                         "use LoRA (peft.LoraConfig).")


def check_lm_head_adapter(policy) -> None:
    """cohort's chunked logprob kernel reads lm_head.weight directly, so a LoRA adapter on lm_head would never
    be used nor trained (TRL guards its fused Liger loss the same way)."""
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    if head is not None and any(hasattr(head, a) for a in ("lora_A", "lora_embedding_A")):
        raise ValueError("peft_config targets lm_head, but cohort's logprob kernel reads lm_head.weight directly, "
                         "so the adapter would be silently ignored: remove 'lm_head' from target_modules, or train "
                         "the whole head with modules_to_save=['lm_head'].")


def _processor_of(model, cfg):
    """GRPOTrainer(model=<object>) without processing_class: AutoProcessor from the model's config
    _name_or_path (a tokenizer for a text model), with a pad token (the EOS) when it has none."""
    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    try:
        if not name:
            raise OSError("the model's config has no _name_or_path")
        proc = AutoProcessor.from_pretrained(name, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"GRPOTrainer(model=<a model object>): no processing_class given and none could be loaded "
                          f"from the model's config._name_or_path={name!r} ({exc}); pass processing_class=<its "
                          "tokenizer>.") from exc
    tok = getattr(proc, "tokenizer", proc)
    if getattr(tok, "pad_token", "") is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return proc


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


def apply_model_init_kwargs(kwargs: dict | None, cfg) -> str:
    """GRPOConfig(model_init_kwargs=...) onto cfg.model: the keys cohort's loader takes; others raise ConfigError.
    Returns the 4-bit quantisation a `quantization_config` asks for ("nf4" / "fp4", QLoRA), else "none": the
    facade loads the named model so (cohort.policy.model.load_policy), and hands it in as it is."""
    quantization = "none"
    for key, value in (kwargs or {}).items():
        if value is None or (key == "revision" and value == "main"):  # TRL's scripts pass their defaults
            continue
        if key == "quantization_config":
            quantization = four_bit_quant_type(value)
            why = missing_support(str(cfg.train.device))  # before any weights load
            if why is not None:
                raise ConfigError(f"GRPOConfig(model_init_kwargs={{'quantization_config': ...}}) (QLoRA): {why}")
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
    return quantization


def four_bit_quant_type(config: Any) -> str:
    """The quant type of a transformers BitsAndBytesConfig (or its dict) that loads 4-bit weights, as
    model.quantization names it; ConfigError for what cohort does not train on (8-bit, other methods)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    method = get("quant_method", "bitsandbytes")
    method = str(getattr(method, "value", method))  # transformers' QuantizationMethod enum, or its string
    kind = str(get("bnb_4bit_quant_type", "fp4"))
    if method != "bitsandbytes" or not get("load_in_4bit", False) or kind not in ("nf4", "fp4"):
        shown = (f"{type(config).__name__}(quant_method={method!r}, load_in_4bit={get('load_in_4bit', False)}, "
                 f"load_in_8bit={get('load_in_8bit', False)}, bnb_4bit_quant_type={kind!r})")
        raise ConfigError(f"GRPOConfig(model_init_kwargs={{'quantization_config': {shown}}}): cohort trains LoRA "
                          "adapters on 4-bit bitsandbytes weights only (QLoRA): use BitsAndBytesConfig(load_in_4bit=True, "
                          "bnb_4bit_quant_type='nf4') with a peft_config, or no quantization_config")
    return kind


def disable_dropout(model) -> None:
    """GRPOConfig(disable_dropout=True): every Dropout of the policy at p=0, as TRL does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0

"""The models of a run, from `cohort.setup.build_components`: where they live (device, dtype), the policy
loaded or handed in (a vision-language model through `cohort.vision.setup`), LoRA adapters, the chat template
override, gradient checkpointing, the frozen reference copy, and FSDP sharding of both.
"""

from __future__ import annotations

import copy

import torch

from cohort.agents.templates import apply_chat_template_override
from cohort.config import CohortConfig
from cohort.distributed import fsdp
from cohort.errors import ConfigError
from cohort.forward.packed_attention import use_packed_kernel
from cohort.forward.packing import compile_decoder_layers
from cohort.policy.model import load_policy, resolve_model_path
from cohort.policy.model import resolve_dtype as model_dtype
from cohort.policy.quantized import is_4bit
from cohort.setup.engine import generate_replaced
from cohort.vision import setup as vision
from cohort.vision.model import is_vision_checkpoint, is_vision_model
from cohort.vision.setup import lora_targets


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name!r} but CUDA is not available here; use train.device=cpu or auto.")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on a GPU (weights read in place by the engine) and float32 on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return model_dtype(name)


def prepare_policy(cfg: CohortConfig, policy, tokenizer, *, device: torch.device, dtype: torch.dtype, echo):
    """The policy ready to train: loaded from model.name_or_path unless handed in (facade, tests), checked and
    prepared for vision, wrapped in LoRA, with the chat template override and gradient checkpointing applied.
    Returns (policy, tokenizer, processor); the processor is None for text models."""
    use_packed_kernel(cfg.model.packed_attention, device)  # before the model loads: a missing package fails fast
    tokenizer, processor = vision.split_processor(tokenizer)  # a VLM's processor handed in (facade, tests)
    m = cfg.model
    if policy is None:
        if m.quantization != "none" and is_vision_checkpoint(resolve_model_path(m.name_or_path, m.gguf_file)):
            raise ConfigError(f"model.quantization={m.quantization!r}: 4-bit vision-language models are not "
                              "supported yet; use model.quantization=none (LoRA on model.dtype weights)")
        loaded = vision.load_model(cfg, dtype=dtype, device=device)  # None unless a vision-language model
        policy, tokenizer, processor = loaded or (*load_policy(
            m.name_or_path, dtype=dtype, device=device, gguf_file=m.gguf_file, trust_remote_code=m.trust_remote_code,
            attn_implementation=m.attn_implementation, quantization=m.quantization), None)
    elif next(policy.parameters()).device != device and not is_4bit(policy):  # 4-bit: stays where bnb put it
        policy.to(device)  # a model object handed in (facade, tests) trains where the config says
    check_quantized(cfg, policy, device)
    vision.check_settings(cfg, policy, hf_generate=cfg.generation.engine == "hf" or generate_replaced(policy))
    vision.prepare_policy(cfg, policy, echo)
    policy = with_lora(cfg, policy)
    if cfg.model.chat_template and tokenizer is not None:  # before any prompt is rendered
        apply_chat_template_override(tokenizer, cfg.model.chat_template)
    if cfg.model.gradient_checkpointing:
        # transformers >= 5.2x renamed it (the old name warns); older releases have only the old one
        enable = getattr(policy, "activation_checkpointing_enable", None) or policy.gradient_checkpointing_enable
        enable()
    return policy, tokenizer, processor


def check_quantized(cfg: CohortConfig, policy, device: torch.device) -> None:
    """model.quantization against the policy: cohort quantises the model it loads (a model handed in comes as
    it is), a 4-bit model trains LoRA adapters only, and vision-language models are not quantised yet (a
    checkpoint is refused before it loads, in prepare_policy)."""
    q, four_bit = cfg.model.quantization, is_4bit(policy)
    if q != "none" and not four_bit:
        raise ConfigError(f"model.quantization={q!r} quantises the model cohort loads from model.name_or_path, but "
                          f"the {type(policy).__name__} handed in is not 4-bit: load it with "
                          f"quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type={q!r}), or "
                          "pass its name instead of the object")
    where = next(policy.parameters()).device
    if four_bit and where.type != device.type:
        raise ConfigError(f"train.device={cfg.train.device!r} resolves to {device.type}, but the 4-bit model handed in "
                          f"is on {where} and bitsandbytes weights cannot be moved; set train.device={where.type}")
    if four_bit and cfg.model.lora_r <= 0 and not hasattr(policy, "peft_config"):  # (adapters handed in: facade)
        raise ConfigError(f"model.lora_r={cfg.model.lora_r} with a 4-bit (bitsandbytes) model: its weights cannot "
                          "be trained, only LoRA adapters on them; set model.lora_r (e.g. 16)")
    if four_bit and is_vision_model(policy):
        raise ConfigError(f"model.quantization={q!r}: 4-bit vision-language models are not supported yet; use "
                          "model.quantization=none (LoRA on model.dtype weights)")


def with_lora(cfg: CohortConfig, policy):
    """model.lora_r > 0: wrap the policy in peft LoRA adapters; the engine runs them unmerged (or, on a 4-bit
    base, merged into its copy: cohort.policy.quantized), checkpoints save only the adapters.

    A 4-bit base gets no peft `prepare_model_for_kbit_training`, as TRL's GRPOTrainer gives it none: get_peft_model
    already freezes every base weight, gradient checkpointing (model.gradient_checkpointing) is enabled after
    this with non-reentrant checkpoints and input gradients (transformers' own), and its remaining step, a float32
    copy of every non-4-bit weight (embeddings, norms, LM head), would double their memory and take the engine
    and the fused logprob kernels off their bf16 path."""
    m = cfg.model
    if m.lora_r <= 0:
        return policy
    try:
        from peft import LoraConfig, get_peft_model  # optional dependency (the peft extra: LoRA)
    except ImportError as exc:
        raise ConfigError(f"model.lora_r={m.lora_r} needs peft: pip install peft (or set model.lora_r=0).") from exc
    lora = LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                      target_modules=lora_targets(policy, list(m.lora_target_modules)), task_type="CAUSAL_LM")
    return get_peft_model(policy, lora)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference policy: the starting weights, frozen (beta > 0 only)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def shard_for_fsdp(cfg: CohortConfig, policy, reference, device: torch.device):
    """train.sharding=fsdp: shard the policy (and the reference) in place; returns (the engine's mirror of the
    policy, the WeightGather that refreshes it after each optimizer step)."""
    ok, why = fsdp.fsdp_available()
    if not ok:
        raise ConfigError(f"train.sharding=fsdp: {why}.")
    mirror = fsdp.mirror_for_engine(policy)  # keeps the loaded bf16 storage: no extra memory
    units = fsdp.shard_model(policy, device=device, master_weights=cfg.train.master_weights,
                             reshard_after_forward=cfg.train.fsdp_reshard_after_forward)
    if reference is not None:
        fsdp.shard_model(reference, device=device, master_weights=False, trainable=False)
    return mirror, fsdp.WeightGather(policy, mirror, units)


def compile_layers(cfg: CohortConfig, policy, reference, device: torch.device, *, sharded: bool) -> None:
    """model.compile_layers on a GPU: torch.compile each decoder layer (bench/grpo_step.py's fast row); the
    sharded policy compiles its forward only."""
    if cfg.model.compile_layers and device.type == "cuda":
        compile_decoder_layers(policy, forward_only=sharded)
        if reference is not None:
            compile_decoder_layers(reference, forward_only=sharded)

"""A 4-bit base model (QLoRA, `model.quantization`) and the rollout engine's merged copy of it.

The policy loads through bitsandbytes (`bnb_config`: nf4 or fp4 codes, double-quantised absmax, computing in
the model's dtype) and trains peft LoRA adapters on top; only those adapters change during training.

cohort's engine reads weights as plain tensors (fused QKV copies, CUDA graphs over fixed addresses) and bnb's
packed 4-bit `Params4bit` are not that. `MergedCopy` builds a plain twin of the model in the compute dtype for
it: every 4-bit linear dequantised once (frozen: never refreshed), every LoRA-adapted one dequantised with its
adapters merged (W + B @ A x scaling, summed in float32 and rounded once), and every other tensor (embeddings,
norms, the LM head, RoPE tables) the policy's own, shared, not copied. The copy's weights live in one flat
buffer whose address does not move, so `refresh` (after each optimizer step) writes the adapted layers in
place and the engine's captured graphs stay valid. An adapted layer is dequantised again at each refresh
rather than kept dequantised beside the copy: the pass reads half a byte and writes two per weight (the step's
time/sync_weights, which bench/qlora.py reports), where a cached dequantised base would be the copy's size
again. `release` / `restore` free and re-make the flat buffer around the update
(generation.release_kv_during_update), as the KV pool is. `MergedCopyEngine` is the engine wrapped so that
it happens. Cost: the copy is 2 bytes per base weight (bf16) on top of the 4-bit base's ~0.52 (4 bits plus
the double-quantised absmax).

The merged weights round W + delta to bf16, as a merge before a vLLM push does: an adapter update smaller than
half a bf16 step of W is not seen by the sampler until it grows (the sampler importance weights,
loss.sampler_is_correction, correct for the difference). generation.quantized_engine=4bit samples from the
trainer's own 4-bit layers and unmerged adapters instead.

`missing_support` says why this machine cannot load 4-bit weights (no CUDA, no bitsandbytes, no peft); the
config preflight raises it before any model loads.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import BitsAndBytesConfig

QUANT_TYPES = ("nf4", "fp4")
INSTALL = "pip install 'cohort-rl[qlora]'"


def missing_support(device: str) -> str | None:
    """Why 4-bit bitsandbytes weights cannot be trained here on train.device=`device` (None: they can)."""
    if not str(device).startswith(("auto", "cuda")):
        return f"4-bit bitsandbytes weights need a CUDA GPU and train.device={device!r} is not one"
    if not torch.cuda.is_available():
        return (f"4-bit bitsandbytes weights need a CUDA GPU and this machine has none (train.device={device!r}); "
                "run on a GPU, or set model.quantization=none to train LoRA on model.dtype weights")
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"it needs the bitsandbytes package, which is not installed: {INSTALL} (GPU machines only)"
    if importlib.util.find_spec("peft") is None:
        return "the LoRA adapters on the 4-bit base need peft, which is not installed: pip install 'cohort-rl[peft]'"
    return None


def bnb_config(quant_type: str, compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    """4-bit weights as QLoRA loads them: `quant_type` codes with double-quantised absmax, matmuls in
    `compute_dtype` (the model's dtype)."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quantization {quant_type!r}: use one of {QUANT_TYPES}")
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def _is_4bit_param(p: Any) -> bool:
    return type(p).__name__ == "Params4bit"  # by name: bitsandbytes is optional, and absent where no 4-bit model is


def is_4bit(model: nn.Module) -> bool:
    """Whether any of `model`'s weights are bitsandbytes 4-bit (a QLoRA base, loaded here or handed in)."""
    return any(_is_4bit_param(p) for p in model.parameters())


def _state_bytes(state: Any) -> int:
    """Device bytes of a 4-bit weight's quantisation state: absmax, and the nested state of double quantisation."""
    total = 0
    for name in ("absmax", "code"):
        t = getattr(state, name, None)
        total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    nested = getattr(state, "state2", None)
    return total + (_state_bytes(nested) if nested is not None else 0)


def weight_bytes(model: nn.Module) -> int:
    """Device bytes of `model`'s parameters as loaded: 4-bit weights packed, with their quantisation states."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)
        if _is_4bit_param(p) and state is not None:
            total += _state_bytes(state)
    return total


def copy_bytes(model: nn.Module) -> int:
    """Bytes of `MergedCopy`'s buffer for `model`: every 4-bit weight again, dequantised to its compute dtype."""
    total = 0
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        if _is_4bit_param(p) and state is not None:
            total += int(torch.Size(state.shape).numel()) * state.dtype.itemsize
    return total


def lora_copy_bytes(model: nn.Module) -> int:
    """Bytes of a merged copy of a LoRA policy on plain weights (generation.lora_engine=merged): every adapted
    layer's base weight once more, in its dtype."""
    total = 0
    layers: list[Any] = [m for m in model.modules() if _is_lora(m)]  # peft's LoRA layers
    for layer in layers:
        weight = layer.get_base_layer().weight
        if weight is not None:
            total += int(weight.numel()) * int(weight.element_size())
    return total


def _dequantized(module: Any) -> torch.Tensor:
    """A linear layer's weight as a plain tensor: bnb's 4-bit codes dequantised, or the weight itself."""
    w = module.weight
    if not _is_4bit_param(w):
        return w.detach()
    import bitsandbytes.functional as bnbf  # optional dependency (the qlora extra): only 4-bit models reach here

    return bnbf.dequantize_4bit(w.data, w.quant_state)


def _is_lora(module: nn.Module) -> bool:
    return hasattr(module, "lora_A") and callable(getattr(module, "get_base_layer", None))


@dataclass
class _Slot:
    """One weight of the copy: the twin's Parameter, the layer it comes from, and that layer's adapters."""

    param: nn.Parameter
    base: Any  # the 4-bit (or plain) layer under the adapters (an HF / bnb module, reached by attribute name)
    lora: Any  # the peft LoRA layer; None: a frozen 4-bit layer, dequantised once
    offset: int  # where its elements start in the flat buffer
    shape: torch.Size


class MergedCopy:
    """The engine's plain copy of a 4-bit (peft) policy: see the module docstring. `model` is a *ForCausalLM of
    the policy's class whose tensors are the flat buffer's views and the policy's own."""

    def __init__(self, policy: nn.Module) -> None:
        get_base = getattr(policy, "get_base_model", None)
        source: Any = get_base() if callable(get_base) else policy
        embedding = source.get_input_embeddings().weight
        self.dtype, self.device = embedding.dtype, embedding.device
        self.four_bit = is_4bit(source)  # else a LoRA policy on plain weights (generation.lora_engine=merged)
        self.model = _plain_twin(source)
        self.slots = _fill(self.model, source, self.dtype, self.device)
        self.numel = sum(s.shape.numel() for s in self.slots)
        self.flat: torch.Tensor | None = None
        self.restore()

    @property
    def bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def released(self) -> bool:
        return self.flat is None

    @torch.no_grad()
    def refresh(self, everything: bool = False) -> None:
        """Write the adapted layers' merged weights (after an optimizer step); `everything`: the frozen 4-bit
        layers too (once, and after `restore`)."""
        for slot in self.slots:
            if slot.lora is None and not everything:
                continue
            base = _dequantized(slot.base)
            if slot.lora is None:
                slot.param.copy_(base)
                continue
            merged = base.to(torch.float32, copy=True)  # a plain base is the policy's own weight: never add into it
            for name in slot.lora.active_adapters:
                if name in slot.lora.lora_A or name in getattr(slot.lora, "lora_embedding_A", {}):
                    merged += slot.lora.get_delta_weight(name).float()
            slot.param.copy_(merged)

    def release(self) -> None:
        """Free the buffer (between generate calls); `restore` makes it again."""
        self.flat = None
        for slot in self.slots:
            slot.param.data = torch.empty(0, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def restore(self) -> None:
        """(Re)allocate the buffer and write every weight. The caching allocator normally returns the freed block,
        so the weights come back at the same addresses; the engine's sync_weights recaptures graphs if not."""
        if self.flat is not None:
            return
        self.flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        for slot in self.slots:
            slot.param.data = self.flat[slot.offset:slot.offset + slot.shape.numel()].view(slot.shape)
        self.refresh(everything=True)


def _plain_twin(source: nn.Module) -> nn.Module:
    """An empty (meta) model of `source`'s class and config, without its quantisation settings."""
    config = copy.deepcopy(source.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        twin = type(source)(config)
    return twin.eval().requires_grad_(False)


def _fill(twin: nn.Module, source: nn.Module, dtype: torch.dtype, device: torch.device) -> list[_Slot]:
    """Point every tensor of `twin` at its source: 4-bit and adapted weights at slots of the coming flat buffer,
    the rest at the policy's own tensors. A ValueError names what the copy cannot hold (the engine then falls
    back to Hugging Face generate)."""
    slots: list[_Slot] = []
    offset = 0
    for name, module in twin.named_modules():
        src: Any = source.get_submodule(name) if name else source
        lora = src if _is_lora(src) else None
        inner = src.get_base_layer() if lora is not None else src
        if lora is not None and (getattr(lora, "lora_variant", None) or getattr(lora, "merged", False)):
            raise ValueError(f"{name}: a LoRA variant (DoRA, ...) or an adapter merged into the 4-bit weights")
        weight = getattr(inner, "weight", None)
        if (lora is not None or _is_4bit_param(weight)) and weight is not None:
            shape = torch.Size(weight.quant_state.shape if _is_4bit_param(weight) else weight.shape)
            if tuple(module.weight.shape) != tuple(shape):
                raise ValueError(f"{name}: weight of shape {tuple(shape)} where the plain model has "
                                 f"{tuple(module.weight.shape)}")
            param = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)
            module._parameters["weight"] = param
            slots.append(_Slot(param, inner, lora, offset, shape))
            offset += shape.numel()
            if "bias" in module._parameters:
                module._parameters["bias"] = inner.bias
            continue
        for key in list(module._parameters):
            module._parameters[key] = _own(src, key, name, "_parameters")
        for key in list(module._buffers):
            module._buffers[key] = _own(src, key, name, "_buffers")
    return slots


def _own(src: nn.Module, key: str, name: str, kind: str) -> Any:
    """The policy module's own parameter or buffer `key` (shared with the copy: it never trains)."""
    table = getattr(src, kind)
    if key not in table:
        raise ValueError(f"{name}.{key}: the 4-bit policy's {type(src).__name__} has no such tensor")
    return table[key]


class MergedCopyEngine:
    """cohort's engine over a `MergedCopy`: refreshes the copy after each optimizer step, frees it with the KV
    pool during the update, and is otherwise the engine it wraps."""

    def __init__(self, engine: Any, merged: MergedCopy) -> None:
        self.engine, self.merged = engine, merged

    def _ready(self) -> None:
        if self.merged.released:
            self.merged.restore()
            self.engine.runner.ensure_kv_cache()  # the pool first: a graph recapture below reads it
            self.engine.sync_weights()  # recaptures the graphs if the buffer came back elsewhere

    def generate(self, prompts, params):
        self._ready()
        return self.engine.generate(prompts, params)

    def generate_turns(self, prompts, params, on_turn_end):
        self._ready()
        return self.engine.generate_turns(prompts, params, on_turn_end)

    def sync_weights(self) -> None:
        if not self.merged.released:  # a released copy is written whole when the next generate restores it
            self.merged.refresh()
            self.engine.sync_weights()

    def release_kv_cache(self) -> None:
        self.engine.release_kv_cache()
        self.merged.release()

    def engine_name(self) -> str:
        what = "the 4-bit base" if self.merged.four_bit else "the LoRA-adapted layers"
        return f"{self.engine.engine_name()}, on a merged {self.merged.dtype_name} copy of {what}"

    def __getattr__(self, name: str) -> Any:
        if name in ("engine", "merged"):  # not set yet (a copy being built): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.engine, name)

"""Which engine forward runs which model: chosen by `config.model_type`.

| model_type | class | module |
| --- | --- | --- |
| llama, mistral, qwen2, qwen3 | DecoderForward | decoder.py |
| gemma3_text (Gemma3ForCausalLM) | Gemma3Forward | gemma3.py |
| qwen3_moe | Qwen3MoeForward | qwen3_moe.py |
| qwen2_vl, qwen2_5_vl, idefics3, smolvlm (their language model) | VisionDecoderForward | cohort.vision.engine_forward, registered by `cohort.vision` |

`engine_supports(model)` answers (ok, reason) without building anything: the trainer uses the reason to
say why it falls back to the Hugging Face backend. `build_forward` constructs the family's forward.
A family defined above the engine (the vision plug-in) adds itself with `register_family`: the engine never
imports it.
"""

from __future__ import annotations

from torch import nn

from cohort.engine.attention import AttentionOps
from cohort.engine.models.decoder import DecoderForward, unwrap_model
from cohort.engine.models.gemma3 import Gemma3Forward
from cohort.engine.models.qwen3_moe import Qwen3MoeForward

FAMILIES: list[type[DecoderForward]] = [DecoderForward, Gemma3Forward, Qwen3MoeForward]


def register_family(cls: type[DecoderForward]) -> None:
    """Add an engine forward for the model types `cls.model_types` (idempotent)."""
    taken = {t for family in FAMILIES if family is not cls for t in family.model_types}
    clash = sorted(taken & set(cls.model_types))
    if clash:
        raise ValueError(f"{cls.__name__}: model types {clash} already have an engine forward")
    if cls not in FAMILIES:
        FAMILIES.append(cls)


def supported_model_types() -> list[str]:
    return [t for cls in FAMILIES for t in cls.model_types]


def forward_class(model: nn.Module) -> type[DecoderForward] | None:
    model_type = getattr(getattr(unwrap_model(model), "config", None), "model_type", None)
    return next((cls for cls in FAMILIES if model_type in cls.model_types), None)


def engine_supports(model: nn.Module) -> tuple[bool, str]:
    """Whether CohortEngine can run `model`; the reason names what blocks it (for a fallback message)."""
    base = unwrap_model(model)
    cls = forward_class(base)
    if cls is None:
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        return False, (f"model_type={model_type!r} is not supported by the cohort engine (supported: "
                       f"{', '.join(supported_model_types())}); using the reference HF backend.")
    reason = cls.unsupported(base)
    return (False, reason) if reason is not None else (True, "ok")


def build_forward(model: nn.Module, attention: AttentionOps, max_len: int,
                  fuse_projections: bool | None = None) -> DecoderForward:
    """The engine forward of `model`'s family (ValueError naming the reason when none can run it)."""
    ok, reason = engine_supports(model)
    cls = forward_class(model)
    if not ok or cls is None:
        raise ValueError(reason)
    return cls(model, attention, max_len, fuse_projections)

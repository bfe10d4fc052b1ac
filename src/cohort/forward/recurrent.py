"""Models whose layers carry a state along the sequence (Mamba, gated-delta / linear attention: NemotronH,
Qwen3-Next, Qwen3.5's language model), which a packed row cannot hold apart.

A packed row keeps sequences apart through cu_seqlens attention (cohort.forward.packed_attention), but a recurrent
layer's scan and causal convolution run straight across the row: the second sequence would start from the first
one's state (measured on a tiny NemotronH: 0.13 nats off on its completion tokens). Such models get one
sequence per forward (`cohort.update` cuts their micro-batches so, saying it once), and the packed forward refuses
a row of several of their sequences rather than return wrong logprobs.
"""

from __future__ import annotations

import warnings

# transformers' layer types that carry no state along the sequence; anything else (its "linear_attention" for
# Mamba and gated-delta layers, "mamba", ...) is taken as recurrent
_STATELESS_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention", "moe",
                               "mlp", "dense"})


def _layer_types(model) -> list[str]:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config  # a VLM's language side
    return [str(t) for t in getattr(config, "layer_types", None) or ()]


def has_recurrent_layers(model) -> bool:
    """Whether the (language) model has layers with a recurrent state (its config's layer_types)."""
    return any(t not in _STATELESS_LAYERS for t in _layer_types(model))


def check_one_sequence(model, count: int) -> None:
    """A packed row of `count` sequences for a recurrent model would leak state between them: refuse it."""
    if count > 1 and has_recurrent_layers(model):
        raise ValueError(f"a packed row of {count} sequences for a model with recurrent layers (layer_types "
                         f"{sorted(set(_layer_types(model)))}): their state would flow from one sequence into "
                         "the next; pack one sequence per row (cohort.update does)")


_ANNOUNCED: set[int] = set()


def one_sequence_per_row(model) -> bool:
    """Whether the model's micro-batches must hold one sequence each (recurrent layers); said once per model."""
    if not has_recurrent_layers(model):
        return False
    if id(model) not in _ANNOUNCED:
        _ANNOUNCED.add(id(model))
        warnings.warn("this model has recurrent layers (Mamba / linear attention), which a packed row cannot keep "
                      "apart: each training forward holds one sequence (correct; slower than packing)", stacklevel=3)
    return True

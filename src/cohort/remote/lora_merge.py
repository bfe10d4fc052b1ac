"""What a push carries for a LoRA policy: the plain model's tensors, each adapted weight merged on the fly.

The server serves the base model (`cohort serve BASE`), whose parameters have plain names
(`model.layers.0.self_attn.q_proj.weight`). A peft policy holds them under other names
(`...q_proj.base_layer.weight`) next to its adapters (`...q_proj.lora_A.default.weight`). A push lists the
plain names and sends, for every adapted layer, W + delta (peft's own `get_delta_weight`: B @ A x scaling,
transposed where the layer stores W that way), computed when its bucket is packed: the policy's weights stay
unmerged (no bf16 drift from merging and unmerging in place, as merge-then-unmerge pushes have), and the
extra memory is one merged matrix at a time, not a second model.
"""

from __future__ import annotations

import torch

from cohort.errors import ConfigError

# adapter parameters, never pushed (their effect is in the merged weights)
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


class MergedWeight:
    """An adapted layer's weight as the plain model holds it, computed when the push packs it."""

    def __init__(self, layer) -> None:
        self.layer = layer
        self.base = layer.base_layer.weight
        self.shape, self.dtype = self.base.shape, self.base.dtype

    def detach(self) -> torch.Tensor:
        """The merged weight (send_buckets calls detach() on what it packs)."""
        with torch.no_grad():
            merged = self.base.detach().clone()
            for name in self.layer.active_adapters:
                if name in self.layer.lora_A or name in getattr(self.layer, "lora_embedding_A", {}):
                    merged += self.layer.get_delta_weight(name).to(merged.dtype)
        return merged


def merged_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor | MergedWeight]]:
    """(plain name, tensor or MergedWeight) for every parameter and floating buffer of the base model, in
    module order, tied weights once: the names and shapes `cohort serve BASE` expects."""
    from peft.tuners.lora import LoraLayer  # optional dependency (the peft extra: LoRA)

    base = model.get_base_model()  # type: ignore[operator]
    if getattr(getattr(model, "active_peft_config", None), "use_dora", False):
        raise ConfigError("peft use_dora=True: a DoRA policy cannot be pushed to a server yet (its magnitude "
                          "vector rescales each column); use plain LoRA, or generation.placement=colocate")
    adapted = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    names_of: dict[int, list[str]] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for owner, layer in adapted.items():
        shared = names_of.get(id(layer.base_layer.weight), [])
        if len(shared) > 1:  # a tied embedding: the plain model cannot hold a merged embedding and a base LM head
            raise ConfigError(f"LoRA on {owner} cannot be pushed to a server: its weight is tied to "
                              f"{', '.join(n for n in shared if not n.startswith(owner + '.'))} (tie_word_embeddings), "
                              "and the served model would apply the adapter to both; leave it out of "
                              "model.lora_target_modules, or use generation.placement=colocate")
    out: list[tuple[str, torch.Tensor | MergedWeight]] = []
    for name, param in base.named_parameters():
        if any(part in name for part in _ADAPTER_PARTS):
            continue
        if ".modules_to_save." in name or ".original_module." in name:
            raise ConfigError(f"peft modules_to_save ({name}) are not pushed to a server yet; leave "
                              "modules_to_save unset, or use generation.placement=colocate")
        owner, _, leaf = name.rpartition(".base_layer.")
        if owner in adapted and leaf == "weight":
            out.append((f"{owner}.weight", MergedWeight(adapted[owner])))
        else:
            out.append((name.replace(".base_layer.", "."), param))
    out += [(name.replace(".base_layer.", "."), b) for name, b in base.named_buffers() if b.is_floating_point()]
    return out

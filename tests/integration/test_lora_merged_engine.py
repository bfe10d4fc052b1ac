"""generation.lora_engine=merged on the CPU: cohort's engine samples a LoRA policy on plain weights from a copy of its
adapted layers with the adapters merged (cohort.policy.quantized.MergedCopy, the copy QLoRA uses), which equals the
policy's forward, follows its adapters after each optimizer step, and gives sampling logprobs equal to the trainer's
recompute; the settings it cannot take are refused naming the field."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")

from peft import LoraConfig, get_peft_model
from tests.helpers.engine_checks import assert_sampling_logprobs_match_trainer, nudge_adapters
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model, toy_rows

from cohort.config import CohortConfig
from cohort.data.sources import load_prompt_dataset
from cohort.engine import CohortEngine
from cohort.errors import ConfigError
from cohort.policy.quantized import MergedCopy, MergedCopyEngine, lora_copy_bytes
from cohort.rewards import RewardRunner
from cohort.setup import build_components, build_engine
from cohort.trainer import train

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _lora_policy(tok):
    policy = get_peft_model(tiny_model(tok, seed=3), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                                 task_type="CAUSAL_LM"))
    nudge_adapters(policy)
    return policy


def _cfg(**generation) -> CohortConfig:
    cfg = CohortConfig()
    cfg.generation.max_completion_length, cfg.data.max_prompt_length = 16, 64
    cfg.model.lora_r, cfg.model.lora_alpha = 4, 8
    cfg.generation.lora_engine = "merged"
    for key, value in generation.items():
        setattr(cfg.generation, key, value)
    return cfg


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


def test_the_copy_holds_the_adapted_layers_merged_and_follows_the_adapters():
    tok = make_tiny_tokenizer()
    policy = _lora_policy(tok)
    merged = MergedCopy(policy)
    base = policy.get_base_model()
    assert not merged.four_bit and len(merged.slots) == len(TARGETS) * base.config.num_hidden_layers
    assert merged.bytes == lora_copy_bytes(policy)  # what the memory plan counts
    assert merged.model.model.layers[0].self_attn.k_proj.weight is base.model.layers[0].self_attn.k_proj.weight
    ids = torch.randint(3, len(tok), (2, 12))
    torch.testing.assert_close(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5, rtol=0)
    nudge_adapters(policy, seed=1)
    assert (_logits(merged.model, ids) - _logits(policy, ids)).abs().max() > 1e-3  # stale until refreshed
    merged.refresh()
    torch.testing.assert_close(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_engine_logprobs_equal_the_trainers_forward(mode):
    tok = make_tiny_tokenizer()
    policy = _lora_policy(tok).eval()
    said: list[str] = []
    engine = build_engine(_cfg(lora_engine=mode), policy, tok, torch.device("cpu"), echo=said.append)
    assert isinstance(engine, MergedCopyEngine) == (mode == "merged")
    assert isinstance(engine, CohortEngine) == (mode == "adapters")
    if mode == "merged":
        assert any("merged float32 copy of the LoRA-adapted layers" in s for s in said), said
    assert_sampling_logprobs_match_trainer(engine, policy, tok)


def test_two_steps_train_the_adapters_and_the_engine_samples_the_trained_policy(tmp_path):
    tok = make_tiny_tokenizer()
    cfg = _cfg()
    cfg.data.source = toy_rows
    cfg.generation.num_generations, cfg.generation.max_completion_length = 4, 8
    cfg.train.prompts_per_step, cfg.train.max_steps, cfg.train.learning_rate = 2, 2, 1e-2
    cfg.train.device = "cpu"
    cfg.run.output_dir, cfg.run.report_to = str(tmp_path / "run"), ["jsonl"]
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    rewards = RewardRunner([lambda completions, **kw: [len(c) / 10 for c in completions]])
    comp = build_components(cfg, policy=tiny_model(tok, seed=3), tokenizer=tok, reward_runner=rewards,
                            train_data=data, echo=lambda *a: None)
    assert isinstance(comp.engine, MergedCopyEngine)
    adapters = {n: p.detach().clone() for n, p in comp.policy.named_parameters() if p.requires_grad}
    result = train(cfg, comp, echo=lambda *a: None)
    assert len(result.history) == 2
    assert all(not torch.equal(adapters[n], p) for n, p in comp.policy.named_parameters() if p.requires_grad)
    ids = torch.randint(3, len(tok), (2, 10))  # the copy was refreshed after the last step
    torch.testing.assert_close(_logits(comp.engine.merged.model, ids), _logits(comp.policy, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, fix", [
    ({"model.lora_r": 0}, "model.lora_r=0 trains none"),
    ({"generation.engine": "hf"}, "generation.engine=auto or cohort"),
    ({"train.sharding": "fsdp"}, "gathered copy"),
    ({"generation.lora_engine": "merge"}, "generation.lora_engine"),
])
def test_settings_it_cannot_take_are_refused(change, fix):
    cfg = _cfg()
    for key, value in change.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=r"generation\.lora_engine") as err:
        cfg.validate()
    assert fix in str(err.value)

"""Every branch of the loop runs end to end on the CPU: off-policy updates (mini-batches, iterations), the
KL reference, sequence-level ratios, each loss family, dynamic sampling."""

from __future__ import annotations

import math

import pytest
import torch
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.config import apply_overrides
from cohort.trainer import train

SETTINGS = {
    "off-policy + kl": ["train.mini_batches=2", "train.num_iterations=2", "loss.beta=0.04", "loss.loss_type=grpo"],
    "gspo": ["loss.importance_sampling_level=sequence", "loss.loss_type=grpo", "train.num_iterations=2"],
    "cispo": ["loss.loss_type=cispo", "train.mini_batches=2"],
    "sapo": ["loss.loss_type=sapo"],
    "dr_grpo + rloo": ["loss.loss_type=dr_grpo", "advantage.estimator=rloo", "advantage.scale_rewards=none"],
    "dynamic sampling": ["reward.dynamic_sampling=true", "reward.max_resample_tries=3"],
    "masked truncation": ["generation.mask_truncated_completions=true"],
    "hf generate backend": ["generation.engine=hf"],
    "entropy bonus + top entropy": ["loss.entropy_coef=0.01", "loss.top_entropy_quantile=0.5"],
    "low memory": ["train.master_weights=false", "train.logprob_chunk_tokens=8", "model.gradient_checkpointing=true",
                   "train.optimizer_offload=true",
                   "generation.release_kv_during_update=true", "generation.fuse_projections=false"],
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_loop_branch_runs(name, tmp_path):
    cfg = apply_overrides(toy_config(tmp_path, steps=2), SETTINGS[name]).validate()
    result = train(cfg, toy_components(cfg))
    assert len(result.history) == 2
    for metrics in result.history:
        assert math.isfinite(metrics["reward"]) and math.isfinite(metrics["grad_norm"])
        assert metrics["time/update"] > 0
        if cfg.loss.beta:
            assert "kl" in metrics and math.isfinite(metrics["kl"])
        if "off-policy" in name:
            assert metrics["time/logprobs"] > 0  # old and reference logprobs were computed


def test_lora_trains_only_the_adapters(tmp_path):
    pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    cfg = apply_overrides(toy_config(tmp_path, steps=2), ["model.lora_r=4", "loss.beta=0.04"]).validate()
    comp = toy_components(cfg)
    base_before = {n: p.detach().clone() for n, p in comp.policy.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in comp.policy.named_parameters() if "lora_B" in n}
    result = train(cfg, comp)
    assert all(math.isfinite(m["kl"]) for m in result.history)
    params = dict(comp.policy.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in base_before.items())  # frozen base
    assert any(not torch.equal(params[n], p) for n, p in lora_before.items())  # adapters learned
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "adapter_model.safetensors").is_file()


def test_reward_functions_see_trls_trainer_state(tmp_path):
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import step_aware, tiny_model, toy_rows

    from cohort.data import load_prompt_dataset
    from cohort.rewards import RewardRunner
    from cohort.setup import build_components

    cfg = toy_config(tmp_path, steps=3)
    tok = make_tiny_tokenizer()
    comp = build_components(cfg, policy=tiny_model(tok), tokenizer=tok, reward_runner=RewardRunner([step_aware]),
                            train_data=load_prompt_dataset(toy_rows()).encode(tok, 64))
    assert [m["reward"] for m in train(cfg, comp).history] == [0.0, 1.0, 1.0]


def test_unsupported_architecture_falls_back_to_generate_with_a_reason():
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from cohort.config import CohortConfig
    from cohort.engine.hf_backend import HFGenerateEngine
    from cohort.setup import build_engine

    tok = make_tiny_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    said: list[str] = []
    engine = build_engine(CohortConfig(), model, tok, torch.device("cpu"), said.append)
    assert isinstance(engine, HFGenerateEngine)
    assert said and "falling back to Hugging Face generate" in said[0]


def test_train_time_budget_ends_training_normally(tmp_path):
    """train.max_train_time_s ends the loop like max_steps would: final checkpoint, a line saying why."""
    cfg = apply_overrides(toy_config(tmp_path, steps=5), ["train.max_train_time_s=1e-9"]).validate()
    lines: list[str] = []
    result = train(cfg, toy_components(cfg), echo=lines.append)
    assert len(result.history) == 1 and result.stopped_at is None
    assert any(line.startswith("train.max_train_time_s=1e-09 of training reached after step 1") for line in lines)
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()

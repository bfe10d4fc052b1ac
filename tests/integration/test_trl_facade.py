"""A TRL user switches by changing the import: GRPOConfig/GRPOTrainer map onto the same loop."""

from __future__ import annotations

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, tiny_model, toy_rows

from cohort import GRPOConfig, GRPOTrainer
from cohort.errors import ConfigError


def test_trl_batch_arithmetic_maps_onto_cohort_sections():
    args = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                      num_generations=4, max_steps=12, loss_type="cispo", epsilon_high=4.0, beta=0.04)
    cfg = args.to_cohort()
    # 8 x 4 = 32 completions per generation = 8 prompts x 4; 4 / 2 = 2 optimiser updates per generation
    assert cfg.train.prompts_per_step == 8
    assert cfg.train.mini_batches == 2
    assert cfg.train.max_steps == 6  # 12 optimiser steps / 2 per generation
    # cispo owns epsilon_high and beta but not epsilon: only its own knobs, where they differ from its defaults
    assert cfg.loss.loss_params() == {"beta": 0.04, "epsilon_high": 4.0}


def test_generation_batch_must_hold_whole_groups():
    with pytest.raises(ConfigError, match="multiple of num_generations"):
        GRPOConfig(per_device_train_batch_size=6, num_generations=4)


def test_facade_trains_with_model_object(tmp_path):
    tok = make_tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=3, learning_rate=1e-3, report_to="jsonl",
                      extra={"train.device": "cpu"})
    trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=digit_share, args=args,
                          train_dataset=toy_rows(), processing_class=tok)
    result = trainer.train()
    assert len(result.history) == 3
    assert all("reward" in m and "clip_ratio/region_mean" in m for m in result.history)


def test_facade_takes_a_peft_config(tmp_path):
    peft = pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    tok = make_tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to="jsonl", extra={"train.device": "cpu"})
    trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=digit_share, args=args, train_dataset=toy_rows(),
                          processing_class=tok, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    assert (tmp_path / "run" / "checkpoints" / "step-000001" / "adapter_config.json").is_file()

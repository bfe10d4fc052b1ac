"""GSPO (importance_sampling_level=sequence) on a tiny Qwen3-MoE through the normal trainer path: the cohort
engine generates (routed experts in its forward), the packed forward computes old and new logprobs, and the
update trains the router and the stacked expert weights."""

from __future__ import annotations

import math

import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, toy_rows
from tests.integration.test_trainer_learns import toy_config
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from cohort.config import apply_overrides
from cohort.data import load_prompt_dataset
from cohort.engine import CohortEngine
from cohort.rewards import RewardRunner
from cohort.setup import build_components
from cohort.trainer import train


def tiny_moe(tokenizer) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, max_position_embeddings=256, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    return Qwen3MoeForCausalLM(config)


def test_gspo_step_on_tiny_qwen3_moe(tmp_path):
    cfg = apply_overrides(toy_config(tmp_path, steps=2), [
        "loss.importance_sampling_level=sequence", "loss.loss_type=grpo", "train.num_iterations=2",
        "generation.engine=cohort"]).validate()
    tok = make_tiny_tokenizer()
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    comp = build_components(cfg, policy=tiny_moe(tok), tokenizer=tok, reward_runner=RewardRunner([digit_share]),
                            train_data=data)
    assert isinstance(comp.engine, CohortEngine)
    sparse = comp.policy.model.layers[0].mlp
    before = {"router": sparse.gate.weight.detach().clone(), "experts": sparse.experts.gate_up_proj.detach().clone()}
    result = train(cfg, comp)
    assert len(result.history) == 2
    for metrics in result.history:
        assert math.isfinite(metrics["reward"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
        assert metrics["time/logprobs"] > 0  # num_iterations=2: old logprobs from the packed forward
    assert not torch.equal(sparse.gate.weight, before["router"])
    assert not torch.equal(sparse.experts.gate_up_proj, before["experts"])

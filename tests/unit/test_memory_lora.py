"""LoRA in cohort's memory estimate, and issue 18's 32B plan (bench/scale.py --estimate) as a CPU dry run.

Hand-derived numbers: a LoRA adapter of rank r on a linear of in x out features has r x (in + out)
parameters (A: r x in, B: out x r); the frozen base stays in bf16 (2 bytes), the adapters are fp32 with fp32
gradients and two fp32 Adam moments (4 + 4 + 8 bytes each), and a frozen LM head has no gradient.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from cohort.errors import ConfigError
from cohort.policy.memory import GIB, count_lora_parameters, count_parameters, estimate_memory

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": False}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_lora_count_by_hand_and_against_peft():
    peft = pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    # H=64, Q=64, K=2 x 16=32, I=128, r=4: q 4(64+64)=512, k 4(64+32)=384, v 384, o 512, gate/up 4(64+128)=768
    # each, down 768: 4096 per layer, 2 layers
    assert count_lora_parameters(SMALL, 4, ALL) == 2 * (512 + 384 + 384 + 512 + 3 * 768) == 8192
    assert count_lora_parameters(SMALL, 4, "all-linear") == 8192
    assert count_lora_parameters(SMALL, 4, ["q_proj", "v_proj"]) == 2 * (512 + 384)
    torch.manual_seed(0)
    model = peft.get_peft_model(LlamaForCausalLM(LlamaConfig(**SMALL)),
                                peft.LoraConfig(r=4, target_modules=ALL, task_type="CAUSAL_LM"))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 8192
    with pytest.raises(ConfigError, match="lm_head"):
        count_lora_parameters(SMALL, 4, ["lm_head"])
    with pytest.raises(ConfigError, match="r=0"):
        count_lora_parameters(SMALL, 0, ALL)


def test_lora_terms_by_hand_unsharded_and_sharded():
    p, a = count_parameters(SMALL), 8192
    one = estimate_memory(SMALL, dtype="bf16", token_budget=16, lora_params=a)
    assert (one.weights, one.grads, one.master_weights, one.optimizer) == (2 * p + 4 * a, 4 * a, 0, 8 * a)
    assert one.lm_head_grad == 0 and one.engine_weights == 0
    full = estimate_memory(SMALL, dtype="bf16", token_budget=16)
    assert one.activations == full.activations and one.logits_chunk == full.logits_chunk
    four = estimate_memory(SMALL, dtype="bf16", token_budget=16, lora_params=a, shards=4)
    assert (four.weights, four.grads, four.optimizer) == ((2 * p + 4 * a) // 4, 4 * a // 4, 8 * a // 4)
    assert four.engine_weights == 2 * p  # the engine's whole bf16 copy does not shrink with the ranks
    assert four.lm_head_grad == 0
    with pytest.raises(ConfigError, match="lora_params=-1"):
        estimate_memory(SMALL, lora_params=-1)


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("scale_bench_lora", ROOT / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_32b_plan_on_eight_gpus(scale):
    """docs/benchmarks.md, "Eight GPUs": what fits 8 x 80 GB (90% of 78 GiB free) for Qwen2.5-32B's shape."""
    args = scale.parse_args(["--estimate", "--big-size", "32b", "--big-gpus", "8", "--big-prompts", "2",
                             "--big-token-budget", "2048", "--device", "cpu"])
    full_fp32, full_bf16, lora_fsdp, lora_dp = scale.memory_plan(args)
    full = full_fp32["estimate"]
    assert full.num_params == 32_763_876_352
    # engine: 32.76e9 x 2 bytes = 61.03 GiB on every rank whatever the sharding
    assert full.engine_weights / GIB == pytest.approx(61.03, abs=0.01)
    # sharded fp32 masters, gradients and Adam: 16 bytes / 8 ranks = 2 bytes per parameter = 61.03 GiB too
    assert (full.weights + full.grads + full.optimizer) / GIB == pytest.approx(61.03, abs=0.01)
    assert not any(full_fp32["fits"].values())
    assert full_bf16["fits"] == lora_fsdp["fits"] == {"H100 80GB": False, "H200 141GB": True}
    assert lora_dp["fits"] == {"H100 80GB": True, "H200 141GB": True}
    assert (lora_fsdp["sharding"], lora_dp["sharding"]) == ("fsdp", "none")
    # LoRA + FSDP on 80 GB: the engine copy, the base's shard and the gathered units alone pass 90% of 78 GiB
    e = lora_fsdp["estimate"]
    assert (e.engine_weights + e.weights + e.gathered) / GIB > 0.9 * 78
    table = scale.memory_plan_table(scale.memory_plan(args))
    assert table.count("\n") == 5 and "| LoRA r=16 all-linear, data parallel (train.sharding=none) | none |" in table


def test_32b_lora_row_command(scale, tmp_path):
    args = scale.parse_args(["--big-size", "32b", "--big-gpus", "8", "--big-lora-r", "16", "--big-sharding",
                             "none", "--gpus", "1,8", "--no-trl", "--device", "cpu"])
    rows = scale.plan_rows(args)
    big = next(r for r in rows if r["kind"] == "big")
    assert (big["size"], big["gpus"], big["sharding"]) == ("32b", 8, "none")
    cmd = scale.row_command(args, big, str(tmp_path))
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8" and cmd[cmd.index("--sharding") + 1] == "none"
    assert "model.lora_r=16" in cmd and "--big" in cmd
    assert "model.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]" in cmd



def test_setup_estimates_a_lora_run_as_lora(tmp_path):
    """build_components hands the adapters' count to the estimate: no LM-head gradient, adapter-sized moments."""
    pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    from tests.integration.test_trainer_learns import toy_components, toy_config

    cfg = toy_config(tmp_path, steps=1)
    cfg.train.device = "cpu"
    cfg.model.lora_r, cfg.model.lora_target_modules = 4, ["q_proj", "v_proj"]
    comp = toy_components(cfg)
    adapters = sum(p.numel() for p in comp.policy.parameters() if p.requires_grad)
    est = comp.memory_estimate
    assert 0 < adapters < est.num_params
    assert est.lm_head_grad == 0 and est.grads == 4 * adapters and est.optimizer == 8 * adapters

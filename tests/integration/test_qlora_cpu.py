"""QLoRA's machinery on the CPU, where bitsandbytes is installed (skipped otherwise; CI does not install it): the
engine's merged copy of a 4-bit policy equals the policy's own forward and follows its adapters after each refresh,
the engine's sampling logprobs equal the trainer's recompute on both engine paths, and two training steps run
through build_components with a 4-bit model handed in (cohort refuses to *load* one on the CPU, not to run one).

bitsandbytes repacks 4-bit weights for its AVX512-BF16 CPU kernels on the first no-grad forward (and then computes
in bf16); the tests turn that off so that the CPU runs the same float32 dequantise-and-matmul a GPU runs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (4-bit QLoRA): pip install bitsandbytes")
pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")

from peft import LoraConfig, get_peft_model
from tests.helpers.engine_checks import assert_sampling_logprobs_match_trainer, nudge_adapters
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model, toy_rows
from transformers import AutoModelForCausalLM

from cohort.config import CohortConfig
from cohort.data.sources import load_prompt_dataset
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.policy.quantized import MergedCopy, MergedCopyEngine, bnb_config, is_4bit
from cohort.rewards import RewardRunner
from cohort.setup import build_components, build_engine
from cohort.trainer import train
from cohort.types import SamplingParams


def _four_bit(tmp_path, tok):
    tiny_model(tok, seed=3).save_pretrained(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=bnb_config("nf4", torch.float32),
                                                 dtype=torch.float32, device_map={"": "cpu"})
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False  # see the module docstring
    assert is_4bit(model)
    return model


def _with_adapters(model, targets=("q_proj", "v_proj", "gate_proj", "down_proj")):
    policy = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM"))
    nudge_adapters(policy)
    return policy


def _small_cfg() -> CohortConfig:
    """Lengths that fit the tiny model's 256-token context."""
    cfg = CohortConfig()
    cfg.generation.max_completion_length, cfg.data.max_prompt_length = 16, 64
    return cfg


@torch.no_grad()
def _logits(model, ids):
    return model(ids).logits


def test_merged_copy_is_the_policy_and_follows_its_adapters(tmp_path):
    tok = make_tiny_tokenizer()
    policy = _with_adapters(_four_bit(tmp_path, tok))
    merged = MergedCopy(policy)
    ids = torch.randint(3, len(tok), (2, 12))
    torch.testing.assert_close(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5, rtol=0)
    base = policy.get_base_model()
    # 4-bit weights are copied (adapted or not), everything else is the policy's own tensor
    assert len(merged.slots) == 7 * base.config.num_hidden_layers
    assert sum(s.lora is not None for s in merged.slots) == 4 * base.config.num_hidden_layers
    assert merged.model.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert merged.model.model.layers[0].input_layernorm.weight is base.model.layers[0].input_layernorm.weight
    assert merged.bytes == merged.numel * 4 == sum(s.param.numel() for s in merged.slots) * 4
    packed = [p.detach().clone() for p in base.parameters() if type(p).__name__ == "Params4bit"]
    addresses = [s.param.data_ptr() for s in merged.slots]

    nudge_adapters(policy, seed=1)
    assert (_logits(merged.model, ids) - _logits(policy, ids)).abs().max() > 1e-3  # stale until refreshed
    merged.refresh()
    torch.testing.assert_close(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5, rtol=0)
    assert [s.param.data_ptr() for s in merged.slots] == addresses  # in place: captured graphs stay valid
    assert all(torch.equal(a, b) for a, b in zip(packed, (p for p in base.parameters()
                                                          if type(p).__name__ == "Params4bit")))

    merged.release()
    assert merged.released and all(s.param.numel() == 0 for s in merged.slots)
    nudge_adapters(policy, seed=2)
    merged.restore()
    torch.testing.assert_close(_logits(merged.model, ids), _logits(policy, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["merged_bf16", "4bit"])
def test_engine_logprobs_equal_the_trainers_forward(tmp_path, mode):
    tok = make_tiny_tokenizer()
    policy = _with_adapters(_four_bit(tmp_path, tok)).eval()
    cfg = _small_cfg()
    cfg.generation.quantized_engine = mode
    engine = build_engine(cfg, policy, tok, torch.device("cpu"), echo=lambda *a: None)
    assert isinstance(engine, MergedCopyEngine) == (mode == "merged_bf16")
    assert_sampling_logprobs_match_trainer(engine, policy, tok)


def test_a_copy_it_cannot_make_falls_back_to_generate_and_says_why(tmp_path):
    tok = make_tiny_tokenizer()
    model = _four_bit(tmp_path, tok)
    policy = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, task_type="CAUSAL_LM"))
    said = []
    engine = build_engine(_small_cfg(), policy, tok, torch.device("cpu"), echo=said.append)
    assert isinstance(engine, HFGenerateEngine)
    assert any("generation.quantized_engine=merged_bf16" in s and "DoRA" in s for s in said), said


@pytest.mark.parametrize("release", [False, True], ids=["kept", "released-during-update"])
def test_two_steps_train_the_adapters_and_refresh_the_copy(tmp_path, release):
    tok = make_tiny_tokenizer()
    cfg = CohortConfig()
    cfg.data.source = toy_rows
    cfg.model.lora_r, cfg.model.lora_alpha = 4, 8
    cfg.generation.num_generations, cfg.generation.max_completion_length = 4, 8
    cfg.generation.release_kv_during_update = release
    cfg.train.prompts_per_step, cfg.train.max_steps, cfg.train.learning_rate = 2, 2, 1e-2
    cfg.train.device = "cpu"  # where the model handed in is (auto would be a GPU's CUDA)
    cfg.run.output_dir, cfg.run.report_to = str(tmp_path / "run"), ["jsonl"]
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    # a reward that differs within every group, so the advantages (and the adapters' gradients) are not zero
    rewards = RewardRunner([lambda completions, **kw: [len(c) / 10 for c in completions]])
    comp = build_components(cfg, policy=_four_bit(tmp_path, tok), tokenizer=tok, reward_runner=rewards,
                            train_data=data, echo=lambda *a: None)
    assert isinstance(comp.engine, MergedCopyEngine) and comp.abilities.releases_kv
    adapters = {n: p.detach().clone() for n, p in comp.policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    result = train(cfg, comp, echo=lambda *a: None)
    assert len(result.history) == 2
    assert all(not torch.equal(adapters[n], p) for n, p in comp.policy.named_parameters() if p.requires_grad)
    assert is_4bit(comp.policy)
    comp.engine.generate([[5, 6, 7]], SamplingParams(n=1, max_tokens=2))  # a released copy comes back here
    ids = torch.randint(3, len(tok), (2, 10))
    torch.testing.assert_close(_logits(comp.engine.merged.model, ids), _logits(comp.policy, ids), atol=1e-5, rtol=0)

"""Memory estimate arithmetic, worked by hand for a small Llama config, and the fit check."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cohort.errors import ConfigError
from cohort.policy.memory import GIB, check_fits, count_parameters, estimate_memory

# H=64, L=2, I=128, 4 heads of 16, 2 KV heads -> K = 32, vocab 100, untied.
CFG = LlamaConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
# attention 64*64 (q) + 2*64*32 (k, v) + 64*64 (o) = 12288; MLP 3*64*128 = 24576; norms 2*64 = 128
# -> 36992 per layer, x2 = 73984; embeddings + LM head 2*100*64 = 12800; final norm 64 -> 86848.
P = 86848


def test_parameter_count_by_hand_and_against_transformers():
    assert count_parameters(CFG) == P
    with torch.device("meta"):
        assert sum(p.numel() for p in LlamaForCausalLM(CFG).parameters()) == P
        qwen = Qwen2Config(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True)
        assert count_parameters(qwen) == sum(p.numel() for p in Qwen2ForCausalLM(qwen).parameters())
        smol = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True)
        assert count_parameters(smol) == 134_515_008


def test_bf16_adamw_master_weights_by_hand():
    est = estimate_memory(CFG, dtype="bf16", token_budget=10, chunk_tokens=4, kv_cache_bytes=1000,
                          reference_model=True)
    assert est.weights == 2 * P and est.grads == 2 * P and est.reference == 2 * P
    assert est.master_weights == 4 * P
    assert est.optimizer == 8 * P  # two fp32 moments
    # per layer and token: 2 bytes * (7*64 + 3*32 + 4*128 = 1056) + 4 * 2*64 = 2624; outer 2*2*64 = 256
    assert est.activations == 10 * (2 * 2624 + 256)
    assert est.logits_chunk == 4 * 100 * (2 + 4 + 4 + 2)  # bf16 logits, fp32 copy and exp, bf16 gradient
    assert est.lm_head_grad == 100 * 64 * (4 + 2)  # fp32 accumulator + one bf16 chunk product
    assert est.kv_cache == 1000
    assert est.total == 2 * P * 3 + 4 * P + 8 * P + 55040 + 4800 + 38400 + 1000


def test_checkpointing_bf16_optimizer_fp32_and_param_count_only():
    est = estimate_memory(CFG, dtype="bf16", master_weights_fp32=False, token_budget=10,
                          gradient_checkpointing=True)
    assert est.master_weights == 0 and est.optimizer == 4 * P  # two bf16 moments
    assert est.activations == 10 * (2 * 2 * 64 + 2624 + 256)
    low = estimate_memory(CFG, dtype="bf16", master_weights_fp32=False, lm_head_grad_fp32=False)
    assert low.lm_head_grad == 100 * 64 * 2  # summed in place in one bf16 buffer
    fp32 = estimate_memory(CFG, dtype=torch.float32, optimizer="sgd", token_budget=10)
    assert fp32.master_weights == 0 and fp32.optimizer == 0 and fp32.weights == 4 * P
    bare = estimate_memory(1_000_000, dtype="bf16", optimizer="adamw_8bit")
    assert bare.activations == 0 and bare.logits_chunk == 0 and bare.optimizer == 2_000_000
    assert bare.lm_head_grad == 0 and fp32.lm_head_grad == 100 * 64 * (4 + 4)
    assert fp32.logits_chunk == 10 * 100 * 8  # fp32: the logits are the working copy; exp() beside them
    assert "unknown" in bare.table() and "total" in bare.table()


def test_check_fits_names_what_to_lower():
    est = estimate_memory(CFG, token_budget=100_000)  # activations dominate: 100k * 5504 bytes = 0.51 GiB
    check_fits(est, device_free_bytes=2 * GIB)
    with pytest.raises(ConfigError, match="activations") as info:
        check_fits(est, device_free_bytes=est.total)  # 90% headroom -> does not fit
    assert "gradient_checkpointing" in str(info.value) and "train.token_budget" in str(info.value)


def test_bad_names():
    with pytest.raises(ConfigError, match="optimizer='lion'"):
        estimate_memory(CFG, optimizer="lion")
    with pytest.raises(ConfigError, match="dtype='int3'"):
        estimate_memory(CFG, dtype="int3")


def test_compiled_layers_completion_tokens_and_engine_by_hand():
    # compiled layers, per layer and token: 2 * (3*64 + 2*64 + 2*32 + 3*128 = 768) + 4 * 2*64 = 2048; outer 256
    est = estimate_memory(CFG, dtype="bf16", token_budget=10, completion_tokens=3, chunk_tokens=4,
                          compiled_layers=True, fused_logprob_kernels=True, engine_bytes=500)
    assert est.activations == 10 * (2 * 2048 + 256)
    assert est.logits_chunk == 3 * 100 * (2 * 2)  # 3 completion rows (fewer than the chunk), two bf16 buffers
    assert est.engine_weights == 500
    assert est.total == sum(est.terms.values())  # no term leaves the device: every phase is within the backward


def test_phases_when_the_kv_pool_is_released_and_the_moments_offloaded():
    est = estimate_memory(CFG, dtype="bf16", master_weights_fp32=False, lm_head_grad_fp32=False, token_budget=10,
                          chunk_tokens=4, kv_cache_bytes=10**6, kv_released_in_update=True, optimizer_offload=True)
    # offloaded moments: one bucket of at most 32Mi elements (here the whole model), two bf16 moments
    assert est.optimizer == 2 * 2 * P
    act, logits, head = 10 * (2 * 2624 + 256), 4 * 100 * 12, 100 * 64 * 2
    assert (est.activations, est.logits_chunk, est.lm_head_grad) == (act, logits, head)
    assert est.phases == {
        "backward": 2 * P + 2 * P + act + logits + head,  # no KV pool, no moments on the device
        "optimizer_step": 2 * P + 2 * P + 4 * P,
        "generation": 2 * P + 10**6,
    }
    assert est.total == max(est.phases.values()) == 10**6 + 2 * P
    assert "generation" in est.table()


@pytest.mark.parametrize("dtype, b", [("bf16", 2), ("fp32", 4)])
@pytest.mark.parametrize("completion", [6, None])
def test_keep_logits_counts_every_completion_rows_logits(dtype, b, completion):
    """train.keep_logits: the logprob kernel holds completion tokens x vocab x b bytes from forward to backward."""
    kw = dict(dtype=dtype, token_budget=10, completion_tokens=completion, chunk_tokens=4, fused_logprob_kernels=True)
    base, kept = estimate_memory(CFG, **kw), estimate_memory(CFG, keep_logits=True, **kw)
    extra = (completion or 10) * 100 * b
    assert kept.logits_chunk - base.logits_chunk == extra
    assert kept.phases["backward"] - base.phases["backward"] == extra
    assert kept.total - base.total == extra  # the backward is the peak of this config
    assert kept.phases["optimizer_step"] == base.phases["optimizer_step"]  # gone before the step


def test_memory_plan_passes_train_keep_logits():
    from tests.helpers.tiny_models import tiny_llama

    from cohort.config import CohortConfig
    from cohort.setup.memory_plan import micro_batch_tokens, plan_memory

    ests = []
    for keep in (False, True):
        cfg = CohortConfig()
        cfg.train.keep_logits = keep
        ests.append(plan_memory(cfg, tiny_llama(0), torch.device("cpu"), False, lambda *a: None)[1])
    _, completion = micro_batch_tokens(CohortConfig())
    assert ests[1].logits_chunk - ests[0].logits_chunk == completion * 64 * 4  # tiny_llama: vocab 64, fp32

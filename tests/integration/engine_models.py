"""Tiny seeded float32 models of each supported family, shared by the engine tests."""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 96
EOS = 2

# initializer_range 0.1 (not 0.02) makes logits peaked enough that greedy choices are not float32 near-ties.
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               initializer_range=0.1, max_position_embeddings=256, eos_token_id=EOS, bos_token_id=1,
               pad_token_id=0)
# Sliding windows of the tiny windowed families: shorter than most test prompts plus completions, so the
# window really cuts context (and not a multiple of the test block size 4).
WINDOW = 7


def tiny_model(family: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **_COMMON))
    elif family == "qwen2":
        # 6 query heads over 2 KV heads: a non-power-of-two GQA ratio (3), like Qwen2.5's 7 and 6.
        model = Qwen2ForCausalLM(Qwen2Config(num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                             tie_word_embeddings=True, **{**_COMMON, "hidden_size": 96}))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, **_COMMON))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                                                 **_COMMON))
    elif family == "qwen2_sliding":
        # use_sliding_window with max_window_layers=1: layer 0 full attention, layer 1 windowed.
        model = Qwen2ForCausalLM(Qwen2Config(num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                             sliding_window=WINDOW, max_window_layers=1, **_COMMON))
    elif family == "gemma3":
        # Local (windowed, RoPE base 10k) and global (RoPE base 1M with linear scaling) layers, q/k norms, the
        # four (1 + w) norms, sqrt(hidden) embedding scale, a 16-dim head with query_pre_attn_scalar 24 (so the
        # scale is not head_dim ** -0.5), final logit soft-capping, tied embeddings.
        config = Gemma3TextConfig(
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
            final_logit_softcapping=30.0, tie_word_embeddings=True,
            **{**_COMMON, "num_hidden_layers": 3})
        model = Gemma3ForCausalLM(config)
        _randomize_norms(model)
    elif family == "qwen3_moe":
        # 8 experts, top-2 renormalised; layer 1 stays a dense MLP (mlp_only_layers).
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
            **{**_COMMON, "num_hidden_layers": 3}))
    elif family == "gemma2":
        # attention-logit soft-capping (tanh at 50, made small here so it bites) with alternating windows
        config = Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=WINDOW, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
                              attn_implementation="eager", **_COMMON)
        model = Gemma2ForCausalLM(config)
        _randomize_norms(model)
    elif family == "gpt_oss":
        # attention sinks (one learned logit per head), alternating sliding/full layers, 4 experts top-2
        config = GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              **{**_COMMON, "intermediate_size": 32})
        model = GptOssForCausalLM(config)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)  # large enough that dropping them changes every output
    else:
        raise ValueError(family)
    return model.eval()


def _randomize_norms(model: torch.nn.Module) -> None:
    """Gemma initialises its (1 + w) norm weights to 0; random ones make a wrong norm formula visible."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)


def random_prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Batched HF generate (left padding), each output cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=0, eos_token_id=EOS)[:, width:].tolist()
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in out]


def recomputed_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """What the trainer computes: log_softmax(model(prompt + completion).logits / T) at each completion token."""
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, ids[0, len(prompt) :, None])[:, 0].tolist()

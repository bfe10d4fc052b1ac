"""bench/flops.py: the update FLOPs behind the benchmarks' MFU, against hand-derived counts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from flops import attention_width, decoder_params, update_flops

# Qwen2.5-0.5B's shape: 24 layers, 14 heads of 64, hidden 896, vocab 151,936, 494,032,768 weights (tied)
SPEC_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "vocab_size": 151936}


def test_the_bench_update_of_the_05b_shape():
    # 256 sequences of 128 + 256 tokens. Decoder: 494,032,768 - 151,936 x 896 = 357,898,112 weights.
    assert decoder_params(494_032_768, SPEC_05B, tied=True) == 357_898_112
    assert attention_width(SPEC_05B) == 896
    body = 6 * 357_898_112 * 384
    head = 6 * 151_936 * 896 * 256  # completion positions only
    attention = 6 * 24 * 896 * 384 * 385
    flops = update_flops(SPEC_05B, num_params=494_032_768, tied=True, sequences=256, prompt_len=128,
                         completion_len=256)
    assert flops == pytest.approx(256 * (body + head + attention))
    # 7.5% below the 6 N per token count: the prompt positions' LM head (-9.2%) outweighs attention (+1.7%)
    assert flops / (6 * 494_032_768 * 256 * 384) == pytest.approx(0.9249, abs=1e-4)


def test_untied_head_lora_and_explicit_head_dim():
    spec = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 6, "vocab_size": 10}
    # untied: embedding and head (80 each) leave 1,000 - 160 = 840 decoder weights; d_attn = 2 x 6 = 12
    assert decoder_params(1000, spec, tied=False) == 840 and attention_width(spec) == 12
    full = update_flops(spec, num_params=1000, tied=False, sequences=3, prompt_len=2, completion_len=3)
    assert full == 3 * (6 * 840 * 5 + 6 * 80 * 3 + 6 * 1 * 12 * 5 * 6)
    # frozen weights (LoRA): no weight gradients, 4 per weight per token; attention has no weights
    frozen = update_flops(spec, num_params=1000, tied=False, sequences=3, prompt_len=2, completion_len=3,
                          weight_grads=False)
    assert frozen == 3 * (4 * 840 * 5 + 4 * 80 * 3 + 6 * 1 * 12 * 5 * 6)


def test_shared_prompts_count_the_work_done():
    spec = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 6, "vocab_size": 10}
    # 4 sequences of 2 + 3 tokens in groups of 2 sharing the prompt: 2 prompt copies of 2 tokens and 4 x 3
    # completion tokens through the 840 decoder weights; attention pairs: each prompt copy 1 + 2 = 3, each
    # completion (positions 2, 3, 4 see 3, 4, 5 keys) 12
    shared = update_flops(spec, num_params=1000, tied=False, sequences=4, prompt_len=2, completion_len=3, shared=2)
    body = 6 * 840 * (2 * 2 + 4 * 3)
    head = 6 * 80 * 4 * 3
    attention = 12 * 1 * 12 * (2 * 3 + 4 * 12)
    assert shared == pytest.approx(body + head + attention)
    assert update_flops(spec, num_params=1000, tied=False, sequences=4, prompt_len=2, completion_len=3,
                        shared=1) == pytest.approx(4 * (6 * 840 * 5 + 6 * 80 * 3 + 6 * 12 * 5 * 6))

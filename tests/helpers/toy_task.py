"""A toy verifiable task and a tiny real-architecture model for trainer tests on the CPU.

Task: the prompt names a digit; the reward is the share of completion characters equal to that digit.
A randomly initialised model almost never writes the digit, so a rising reward means GRPO is learning.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM


def digit_share(completions, digit, **kwargs):
    """Share of characters equal to the prompt's digit (dense, verifiable)."""
    return [sum(ch == d for ch in c) / max(1, len(c)) for c, d in zip(completions, digit)]


def step_aware(completions, trainer_state, **kwargs):
    """TRL-style use of trainer_state: 1.0 from step 2 on."""
    return [float(trainer_state.global_step >= 2)] * len(completions)


def wrong_length(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def raises(completions, **kwargs):
    raise RuntimeError("reward backend unavailable")


def toy_rows(copies: int = 5) -> list[dict]:
    return [{"prompt": f"Say the digit {d} many times", "digit": str(d)} for d in range(10)] * copies


def tiny_model(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def write_toy_workspace(root: Path) -> tuple[Path, Path]:
    """A saved tiny model folder and a jsonl dataset, as a user would point `cohort train` at them."""
    tok = make_tiny_tokenizer()
    model_dir, data = root / "model", root / "toy.jsonl"
    tiny_model(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data.write_text("".join(json.dumps(r) + "\n" for r in toy_rows()))
    return model_dir, data

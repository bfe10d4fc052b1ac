"""RewardModel on a tiny randomly initialised sequence-classification model saved to disk."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

from cohort.errors import ConfigError
from cohort.rewards import RewardRunner, get_reward_function
from cohort.rewards.reward_model import RewardModel


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    torch.manual_seed(0)
    tok = make_tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_labels=1, pad_token_id=tok.pad_token_id,
    )
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


PROMPTS = ["What is 2 + 3?", "State the final answer: 12 + 30 =", "Hi"]
COMPLETIONS = [" 5", " The answer is 42 because 12 + 30 = 42.", " hello there, friend"]


def _reference_scores(path, texts):
    """One unpadded forward per text: the score is the first logit at the last token."""
    model = LlamaForSequenceClassification.from_pretrained(path).eval()
    tok = make_tiny_tokenizer()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def test_scores_match_unbatched_forward(rm_dir):
    rm = RewardModel(rm_dir, batch_size=2)  # 2 + 1: padding inside a batch and a ragged last batch
    scores = rm(prompts=PROMPTS, completions=COMPLETIONS)
    expected = _reference_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS)])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == 3  # random weights still separate the inputs
    assert rm.name == "tiny-rm"


def test_conversational_uses_chat_template(rm_dir):
    rm = RewardModel(rm_dir)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    texts = rm.texts(prompts, completions)
    assert texts[0] == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n 5<|im_end|>\n"
    assert rm(prompts=prompts, completions=completions) == pytest.approx(_reference_scores(rm_dir, texts), abs=1e-5)


def test_by_path_in_runner(rm_dir):
    runner = RewardRunner([get_reward_function(str(rm_dir), batch_size=3)])
    assert runner.names == ["tiny-rm"]
    result = runner(PROMPTS, COMPLETIONS, [[1]] * 3)
    assert result.rewards.shape == (3, 1) and torch.isfinite(result.rewards).all()


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        RewardModel(tmp_path / "nope")

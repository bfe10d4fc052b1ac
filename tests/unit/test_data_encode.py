"""PromptDataset.encode: chat templates as TRL applies them, left truncation / dropping with counts."""

from __future__ import annotations

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

from cohort.data import PromptDataset, load_prompt_dataset
from cohort.errors import ConfigError

TEXTS = ["What is 2 + 3?", "State the final answer to the following arithmetic problem: 12 + 30 - 7 =", "Hi"]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_tiny_tokenizer_round_trips_and_has_special_tokens(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    for text in [*TEXTS, "unseen words ünïcode 987"]:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_standard_prompts_are_plain_text_tokens(tok):
    ds = PromptDataset([{"prompt": t, "answer": "1"} for t in TEXTS]).encode(tok)
    assert ds.prompt_ids == [tok(t)["input_ids"] for t in TEXTS]
    assert ds.stats.num_truncated == 0 and ds.stats.num_dropped == 0 and ds.stats.num_prompts == 3


def test_conversational_prompts_use_the_chat_template(tok):
    ds = load_prompt_dataset([{"prompt": t} for t in TEXTS], conversational=True, system_prompt="Be brief.").encode(tok)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ds.prompt_ids[0]) == expected
    assert ds.prompt_ids[0][-3:] == tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]


def test_left_truncation_keeps_the_end_and_counts(tok):
    ds = PromptDataset([{"prompt": t} for t in TEXTS])
    full = ds.encode(tok).prompt_ids
    limit = len(full[0])  # TEXTS[0] fits exactly, TEXTS[1] is longer, TEXTS[2] shorter
    assert len(full[1]) > limit > len(full[2])
    out = ds.encode(tok, max_prompt_length=limit, truncation="left")
    assert out.prompt_ids[0] == full[0] and out.prompt_ids[2] == full[2]
    assert out.prompt_ids[1] == full[1][-limit:]
    assert out.stats.num_truncated == 1 and out.stats.num_dropped == 0
    assert out.stats.longest_prompt_tokens == len(full[1])
    assert out.stats.as_metrics()["data/prompts_truncated"] == 1.0
    assert (f"prompt tokens: {len(full[2])} to {len(full[1])} (limit {limit}); 1 truncated (kept their last {limit} "
            "tokens), 0 dropped of 3") == out.stats_line()


def test_drop_removes_rows_and_keeps_columns_aligned(tok):
    ds = PromptDataset([{"prompt": t, "answer": str(i)} for i, t in enumerate(TEXTS)])
    limit = len(tok(TEXTS[0])["input_ids"])
    out = ds.encode(tok, max_prompt_length=limit, truncation="drop")
    assert len(out) == 2 and out.stats.num_dropped == 1 and out.stats.num_truncated == 0
    assert [r["answer"] for r in out] == ["0", "2"]
    batch = out.batch([1, 0])
    assert batch.prompts == [TEXTS[2], TEXTS[0]] and batch.columns == {"answer": ["2", "0"]}
    assert batch.prompt_ids == [out.prompt_ids[1], out.prompt_ids[0]]
    rep = batch.repeat(2)
    assert rep.columns["answer"] == ["2", "2", "0", "0"] and rep.indices == [1, 1, 0, 0]


def test_all_dropped_and_bad_options(tok):
    ds = PromptDataset([{"prompt": t} for t in TEXTS])
    with pytest.raises(ConfigError, match=r"all 3 prompts are longer than max_prompt_length=1"):
        ds.encode(tok, max_prompt_length=1, truncation="drop")
    with pytest.raises(ConfigError, match=r"truncation='right' is not supported"):
        ds.encode(tok, 10, truncation="right")  # type: ignore[arg-type]


def test_conversational_without_chat_template(tok):
    bare = make_tiny_tokenizer()
    bare.chat_template = None
    ds = PromptDataset([{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="has no chat template"):
        ds.encode(bare)


def test_bad_prompt_type(tok):
    with pytest.raises(ConfigError, match=r"row 0 has a prompt of type int"):
        PromptDataset([{"prompt": 3}], source="x.jsonl").encode(tok)


def test_chat_template_kwargs_reach_the_template():
    tok = make_tiny_tokenizer()
    tok.chat_template = tok.chat_template + "{% if think %}<think>{% endif %}"
    ds = PromptDataset([{"prompt": [{"role": "user", "content": "hi"}]}])
    plain, thinking = ds.encode(tok).prompt_ids[0], ds.encode(tok, chat_template_kwargs={"think": True}).prompt_ids[0]
    assert tok.decode(thinking) == tok.decode(plain) + "<think>"

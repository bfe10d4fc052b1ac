"""Built-in reward functions with hand-checked examples, the registry, and DAPO's zero-std group filter."""

from __future__ import annotations

import doctest

import pytest
import torch

import cohort.rewards.builtins as builtins_module
import cohort.rewards.grouping as grouping_module
import cohort.rewards.reasoning_gym as rg_module
from cohort.errors import ConfigError
from cohort.rewards import (
    RewardRunner,
    accuracy,
    answer_format,
    answer_number,
    cosine_scaled_length,
    extract_numeric_answer,
    filter_zero_std_groups,
    get_reward_function,
    reasoning_gym_score,
    soft_overlong_punishment,
    think_answer_format,
    think_format,
)


@pytest.mark.parametrize("module", [builtins_module, rg_module, grouping_module])
def test_doctests(module):
    if module is builtins_module:
        pytest.importorskip("math_verify", reason="needs math-verify: pip install math-verify")
    if module is rg_module:
        pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_accuracy_math_verify():
    pytest.importorskip("math_verify", reason="needs math-verify: pip install math-verify")
    completions = [r"The result is $\frac{2}{6}$", r"\boxed{0.5}", "<think>maybe 3</think><answer>4</answer>", "no idea"]
    solution = [r"\frac{1}{3}", r"\frac{1}{2}", "4", "4"]
    assert accuracy(completions, solution=solution) == [1.0, 1.0, 1.0, 0.0]
    # GSM8K gold: the number after ####; unparsable gold -> None (the sample is "not applicable").
    assert accuracy(["so 72 clips"], answer=["48 + 24 = 72\n#### 72"]) == [1.0]
    assert accuracy(["anything"], solution=["\\unknown{"]) == [None]


def test_accuracy_conversational_and_missing_gold():
    pytest.importorskip("math_verify", reason="needs math-verify: pip install math-verify")
    assert accuracy([[{"role": "assistant", "content": r"\boxed{7}"}]], answer=["7"]) == [1.0]
    with pytest.raises(ValueError, match="needs a 'solution' or 'answer' column"):
        accuracy(["7"])


def test_format_rewards():
    texts = [
        "<think>2+2 is 4</think>\n<answer>4</answer>",
        "<think>2+2 is 4</think> so 4",
        "<answer>4</answer>",
        "<think>a</think><think>b</think><answer>4</answer>",
        "4",
    ]
    assert think_format(texts) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert think_answer_format(texts) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert answer_format(texts) == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_answer_number_gsm8k_and_plain():
    completions = ["Natalia sold 48/2 = 24 clips in May, 48+24 = 72 in total.", "The answer is 71.", "3.50", "-4", "none"]
    gold = ["#### 72", "#### 72", "3.5", "-4", "5"]
    assert answer_number(completions, answer=gold) == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert answer_number(["12"], solution=["12"]) == [1.0]
    assert extract_numeric_answer(r"first 3, then \boxed{12} and a footnote 1") == 12.0


def test_soft_overlong_punishment_by_hand():
    f = soft_overlong_punishment(max_completion_length=10, soft_cache_length=4)
    # start of the ramp at 10 - 4 = 6 tokens: (6 - len) / 4
    assert f(completion_ids=[[0] * n for n in (3, 6, 7, 8, 10, 12)]) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="soft_cache_length=0"):
        soft_overlong_punishment(10, 0)


def test_cosine_scaled_length_by_hand():
    pytest.importorskip("math_verify", reason="needs math-verify: pip install math-verify")
    f = cosine_scaled_length(max_len=10)
    completions = ["7", "7", "7", "8", "8", "8"]
    ids = [[0] * n for n in (0, 5, 10, 0, 5, 10)]
    out = f(completions=completions, completion_ids=ids, answer=["7"] * 6)
    # correct: 1.0 at length 0, (1.0 + 0.5) / 2 at half, 0.5 at max_len; wrong: -1.0, -0.75, -0.5
    assert out == pytest.approx([1.0, 0.75, 0.5, -1.0, -0.75, -0.5])


def test_registry_names_aliases_kwargs_and_unknown():
    assert get_reward_function("accuracy") is accuracy
    assert get_reward_function("think_format_reward") is think_format
    f = get_reward_function("soft_overlong_punishment", max_completion_length=10, soft_cache_length=4)
    assert f(completion_ids=[[0] * 8]) == [-0.5]
    bound = get_reward_function("answer_number", answer=["3"])
    assert bound.__name__ == "answer_number" and bound(completions=["3"]) == [1.0]
    with pytest.raises(ConfigError, match=r"Unknown reward function 'acuracy'. Did you mean 'accuracy'\?"):
        get_reward_function("acuracy")
    with pytest.raises(ConfigError, match=r"could not be built.*max_completion_length"):
        get_reward_function("soft_overlong_punishment", max_len=3)
    with pytest.raises(ConfigError, match="Cannot import module 'no_such_module_xyz'"):
        get_reward_function("no_such_module_xyz:f")


def test_registry_import_path_factory_and_function():
    assert get_reward_function("cohort.rewards.builtins:think_format") is think_format
    f = get_reward_function("cohort.rewards.builtins:soft_overlong_punishment", max_completion_length=4, soft_cache_length=2)
    assert f(completion_ids=[[0] * 3]) == [-0.5]


def test_filter_zero_std_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0, float("nan")])
    keep = filter_zero_std_groups(rewards, num_generations=3)
    assert keep.tolist() == [False, True, False, False]
    assert 1 - keep.float().mean().item() == 0.75  # frac_reward_zero_std
    assert filter_zero_std_groups(torch.tensor([0.0, 1e-9, 0.5, 0.5 + 1e-3]), 2).tolist() == [False, True]
    with pytest.raises(ValueError, match="groups of num_generations=4"):
        filter_zero_std_groups(torch.zeros(6), 4)


def test_reasoning_gym_chain_sum_right_and_wrong():
    pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")
    from cohort.data import load_prompt_dataset

    ds = load_prompt_dataset("reasoning_gym:chain_sum", size=4, seed=3, min_terms=3, max_terms=3, min_digits=2, max_digits=2)
    row = ds[0]
    gold = int(row["answer"])
    assert gold == eval(row["metadata"]["expression"])  # the generator's own expression, checked independently
    completions = [
        f"Adding step by step gives {gold}",
        f"<think>maybe {gold}</think><answer>{gold + 1}</answer>",
        f"<answer>{gold}</answer>",
        "I don't know",
    ]
    n = len(completions)
    out = reasoning_gym_score(completions, answer=[row["answer"]] * n, metadata=[row["metadata"]] * n)
    assert out == [1.0, 0.0, 1.0, 0.0]
    # Through the runner and the registry name, with the row's columns passed by name.
    batch = ds.batch([0] * n)
    result = RewardRunner(["reasoning_gym"])(batch.prompts, completions, [[1]] * n, batch.columns)
    assert result.rewards[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_reasoning_gym_metadata_as_json_string():
    pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")
    import json

    meta = {"source_dataset": "chain_sum", "source_index": 0, "num_terms": 2, "num_digits": 1, "expression": "4 - 1"}
    assert reasoning_gym_score(["3"], ["3"], [json.dumps(meta)]) == [1.0]

"""Data and rewards together, as the trainer uses them: reasoning-gym prompts -> tokens -> step batches ->
G completions per prompt -> rewards with the row's columns, then DAPO's zero-std filter."""

from __future__ import annotations

import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

from cohort.data import PromptSampler, load_prompt_dataset, reasoning_gym_eval_set
from cohort.rewards import RewardRunner, filter_zero_std_groups


def test_reasoning_gym_prompts_to_rewards():
    tok = make_tiny_tokenizer()
    settings = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
    train = load_prompt_dataset(
        "reasoning_gym:chain_sum", size=24, seed=1, conversational=True,
        instruction="Give the final answer in <answer></answer> tags.", **settings,
    )
    held, train, _ = reasoning_gym_eval_set(
        "chain_sum", 12, train, train_seed=1, conversational=True,
        instruction="Give the final answer in <answer></answer> tags.", **settings,
    )
    train = train.encode(tok, max_prompt_length=64)
    held = held.encode(tok, max_prompt_length=64)
    assert not {str(r["prompt"]) for r in held} & {str(r["prompt"]) for r in train}

    g = 4
    sampler = PromptSampler(len(train), prompts_per_step=3, seed=0)
    runner = RewardRunner(["reasoning_gym", "answer_format"], weights=[1.0, 0.5])
    batch = train.batch(sampler.next_indices()).repeat(g)
    # Per group: right in tags, wrong in tags, right without tags, and (last group only) all wrong.
    completions = []
    for k, answer in enumerate(batch.columns["answer"]):
        variants = [f"<answer>{answer}</answer>", f"<answer>{int(answer) + 1}</answer>", f"it is {answer}", "<answer>x</answer>"]
        text = variants[k % g] if k < 2 * g else "<answer>x</answer>"
        completions.append([{"role": "assistant", "content": text}])
    ids = [tok(c[0]["content"])["input_ids"] for c in completions]
    result = runner(batch.prompts, completions, ids, batch.columns, trainer_state={"step": 0})

    assert result.rewards[:g].tolist() == [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]
    assert result.total[:g].tolist() == [1.5, 0.5, 1.0, 0.5]
    assert result.total[2 * g :].tolist() == [0.5] * g
    keep = filter_zero_std_groups(result.total, g)
    assert keep.tolist() == [True, True, False]
    assert torch.isclose(torch.tensor(result.mean["answer_format"]), torch.tensor(10 / 12))

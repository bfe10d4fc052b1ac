"""PromptSampler order and resume; held-out splits disjoint from training."""

from __future__ import annotations

import pytest

from cohort.data import (
    PromptDataset,
    PromptSampler,
    drop_overlap,
    load_prompt_dataset,
    reasoning_gym_eval_set,
    train_eval_split,
)
from cohort.errors import ConfigError


def test_each_epoch_is_a_permutation_reshuffled_per_epoch():
    s = PromptSampler(num_rows=6, prompts_per_step=3, seed=1)
    steps = [s.next_indices() for _ in range(4)]
    epoch0, epoch1 = steps[0] + steps[1], steps[2] + steps[3]
    assert sorted(epoch0) == list(range(6)) and sorted(epoch1) == list(range(6))
    assert epoch0 != epoch1  # seed + epoch reshuffles
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 0
    assert PromptSampler(6, 3, seed=1).next_indices() == steps[0]  # same seed, same order
    assert {tuple(PromptSampler(6, 3, seed=k).next_indices()) for k in range(2, 6)} != {tuple(steps[0])}


def test_step_crossing_an_epoch_boundary():
    s = PromptSampler(num_rows=5, prompts_per_step=3, seed=0)
    a, b = s.next_indices(), s.next_indices()
    assert sorted(a + b[:2]) == list(range(5))  # b takes the last 2 of epoch 0 and 1 of epoch 1
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["position"] == 1


def test_resume_sees_exactly_the_same_prompts():
    straight = PromptSampler(7, 3, seed=4)
    full = [straight.next_indices() for _ in range(6)]
    first = PromptSampler(7, 3, seed=4)
    head = [first.next_indices() for _ in range(2)]
    state = first.state_dict()
    resumed = PromptSampler(7, 3, seed=4)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices() for _ in range(4)] == full


def test_take_continues_the_same_walk():
    a, b = PromptSampler(8, 4, seed=0), PromptSampler(8, 4, seed=0)
    assert a.take(1) + a.take(3) + a.take(2) == b.next_indices() + b.take(2)


def test_resume_with_a_different_dataset_size_fails():
    s = PromptSampler(7, 3, seed=4)
    with pytest.raises(ConfigError, match="the checkpoint saw 9 prompts, the dataset now has 7"):
        s.load_state_dict({"epoch": 0, "position": 3, "num_rows": 9})


def test_bad_sampler_settings():
    with pytest.raises(ConfigError, match="prompts_per_step=0"):
        PromptSampler(3, 0)
    with pytest.raises(ConfigError, match="num_rows=0"):
        PromptSampler(0, 1)


def test_train_eval_split_is_disjoint_even_with_repeated_prompts():
    rows = [{"prompt": f"q{i % 15}", "i": i} for i in range(40)]  # every prompt text occurs 2 or 3 times
    train, held = train_eval_split(PromptDataset(rows), eval_size=0.25, seed=0)
    assert len(held) == 10
    eval_texts = {r["prompt"] for r in held}
    assert not eval_texts & {r["prompt"] for r in train}
    assert len(train) + len(held) < 40  # duplicates of eval prompts were removed from train
    _, again_held = train_eval_split(PromptDataset(rows), eval_size=10, seed=0)
    assert [r["i"] for r in again_held] == [r["i"] for r in held]
    with pytest.raises(ConfigError, match="eval_size=40 gives 40 eval rows out of 40"):
        train_eval_split(PromptDataset(rows), eval_size=40)


def test_reasoning_gym_nearby_seeds_overlap_and_drop_overlap_catches_it():
    # reasoning-gym seeds item i with seed + i: seed 2 repeats seed 1 shifted by one item.
    train = load_prompt_dataset("reasoning_gym:chain_sum", size=20, seed=1)
    nearby = load_prompt_dataset("reasoning_gym:chain_sum", size=20, seed=2)
    held, removed = drop_overlap(nearby, train)
    assert removed == 19 and len(held) == 1
    assert held[0]["prompt"] not in {r["prompt"] for r in train}
    with pytest.raises(ConfigError, match=r"nothing would be left.*reasoning_gym_eval_set"):
        drop_overlap(train.select(range(5)), train)


def test_reasoning_gym_eval_set_is_disjoint_from_train():
    settings = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # 1-digit: value collisions
    train = load_prompt_dataset("reasoning_gym:chain_sum", size=80, seed=1, **settings)
    held, kept, removed = reasoning_gym_eval_set("chain_sum", 80, train, train_seed=1, **settings)
    # the held-out draw stays whole (unbiased); training problems equal to one of it by value are removed
    assert len(held) == 80 and removed > 0 and len(kept) == 80 - removed
    held_texts = {r["prompt"] for r in held}
    assert all(r["prompt"] not in held_texts for r in kept)
    assert sum(r["prompt"] in held_texts for r in train) == removed

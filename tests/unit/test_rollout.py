"""collect_rollouts: layout, metrics, DAPO dynamic sampling and truncation masking with a scripted engine."""

from __future__ import annotations

import torch

from cohort.data import PromptBatch
from cohort.rewards import RewardRunner
from cohort.rollout import collect_rollouts
from cohort.types import Completion, SamplingParams


class ScriptedEngine:
    """Prompt p's completions are the token lists [p, j] (j = sample index); the last one hits the length cap."""

    def generate(self, prompts, params):
        return [[Completion([p[0], j], [-0.5, -0.5], "length" if j == params.n - 1 else "stop")
                 for j in range(params.n)] for p in prompts]

    def sync_weights(self):
        pass


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def reward_by_prompt(prompts, completion_ids, **kwargs):
    # even prompts: every sample gets 1 (a zero-std group); odd prompts: the sample index
    return [1.0 if ids[0] % 2 == 0 else float(ids[1]) for ids in completion_ids]


def feeder():
    state = {"next": 0}

    def take(count):
        ids = list(range(state["next"], state["next"] + count))
        state["next"] += count
        return PromptBatch(prompts=[f"p{i}" for i in ids], prompt_ids=[[i] for i in ids], columns={}, indices=ids)
    return take


def run(**kw):
    return collect_rollouts(ScriptedEngine(), Tok(), feeder(), 4, SamplingParams(n=3), RewardRunner([reward_by_prompt]),
                            advantage_kwargs={"scale_rewards": "group"}, trainer_state={}, **kw)


def test_plain_step_keeps_every_group_and_counts_zero_std():
    batch = run()
    assert len(batch) == 12 and batch.prompt_ids[:3] == [[0], [0], [0]]
    assert batch.metrics["frac_reward_zero_std"] == 0.5  # prompts 0 and 2
    assert torch.equal(batch.advantages[:3], torch.zeros(3))
    assert abs(batch.metrics["completions/clipped_ratio"] - 1 / 3) < 1e-6


def test_dynamic_sampling_refills_with_informative_groups():
    batch = run(dynamic_sampling=True, max_resample_tries=5)
    # 0-3 keeps 1, 3 (half informative), so the second try draws 2 / 0.5 = 4 prompts: 4-7 keeps 5, 7
    assert [p[0] for p in batch.prompt_ids[::3]] == [1, 3, 5, 7]
    assert batch.metrics["sampling/tries"] == 2.0 and batch.metrics["sampling/groups_drawn"] == 8.0
    assert batch.metrics["frac_reward_zero_std"] == 0.5
    assert (batch.rewards.view(4, 3).std(dim=1) > 0).all()


def test_dynamic_sampling_oversampling_is_capped_and_keeps_only_the_step():
    # only prompt 1 of 0-3 is informative when the reward is 1 for even prompts and prompts > 1
    def mostly_equal(prompts, completion_ids, **kwargs):
        return [float(ids[1]) if ids[0] == 1 else 1.0 for ids in completion_ids]

    batch = collect_rollouts(ScriptedEngine(), Tok(), feeder(), 4, SamplingParams(n=3), RewardRunner([mostly_equal]),
                             advantage_kwargs={"scale_rewards": "group"}, trainer_state={},
                             dynamic_sampling=True, max_resample_tries=2, max_oversample=2)
    # try 1 draws 0-3 and keeps 1; rate 1/4 asks 12 prompts, the cap allows 2 x 3 = 6 (4-9), none informative;
    # the last try fills the three missing groups with all-equal ones, in draw order
    assert [p[0] for p in batch.prompt_ids[::3]] == [1, 4, 5, 6]
    assert batch.metrics["sampling/groups_drawn"] == 10.0 and len(batch) == 12


def test_dynamic_sampling_fills_the_step_on_its_last_try():
    batch = run(dynamic_sampling=True, max_resample_tries=1)
    assert len(batch) == 12  # one try: every group is kept
    assert [p[0] for p in batch.prompt_ids[::3]] == [0, 1, 2, 3]


def test_truncated_completions_can_be_masked():
    batch = run(mask_truncated_completions=True)
    assert batch.loss_mask_keep == [True, True, False] * 4


def test_logged_reward_is_the_raw_weighted_sum_under_either_aggregation():
    """TRL's `reward` and `reward_std` are the mean and std of the raw weighted sum of the functions' rewards,
    also under normalize_then_sum, whose combined reward is normalised (TRL's test: weights 0.7/0.3 on constant
    rewards 1 and 0 log 0.7)."""
    def one(completion_ids, **kwargs):
        return [1.0] * len(completion_ids)

    def zero(completion_ids, **kwargs):
        return [0.0] * len(completion_ids)

    for aggregation in ("sum_then_normalize", "normalize_then_sum"):
        batch = collect_rollouts(ScriptedEngine(), Tok(), feeder(), 4, SamplingParams(n=3),
                                 RewardRunner([one, zero], weights=[0.7, 0.3]),
                                 advantage_kwargs={"scale_rewards": "group", "reward_weights": [0.7, 0.3],
                                                   "multi_objective_aggregation": aggregation},
                                 trainer_state={})
        assert abs(batch.metrics["reward"] - 0.7) < 1e-6, aggregation
        assert batch.metrics["reward_std"] < 1e-6
    by_prompt = collect_rollouts(ScriptedEngine(), Tok(), feeder(), 4, SamplingParams(n=3),
                                 RewardRunner([reward_by_prompt, zero], weights=[2.0, 1.0]),
                                 advantage_kwargs={"scale_rewards": "group", "reward_weights": [2.0, 1.0],
                                                   "multi_objective_aggregation": "normalize_then_sum"},
                                 trainer_state={})
    raw = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0] * 2) * 2.0  # prompts 0, 1, 2, 3
    assert abs(by_prompt.metrics["reward"] - raw.mean().item()) < 1e-6
    assert abs(by_prompt.metrics["reward_std"] - raw.std().item()) < 1e-6

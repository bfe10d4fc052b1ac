"""REINFORCE++, REINFORCE++-baseline, ReMax, OPO and GPG: hand-derived numbers (arithmetic in the comments),
a re-derivation of verl's formulas on token-level tensors, and the rollout's greedy baseline and lengths.

The ``verl_*`` functions below re-derive, in this file's own code, the outcome-reward estimators of verl's
``verl/trainer/ppo/core_algos.py`` (read at commit 012be9d9dcb7c38499f23616142870d2682757fc) and the
whitening of ``verl/utils/torch_functional.py`` (``masked_whiten`` with ``masked_var(unbiased=True)``): verl
works on [B, T] token tensors with the outcome reward on each row's last response token; cohort works on [N]
rows. verl itself is not installed here.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.unit.test_rollout import Tok  # the decoding stub those tests share

from cohort.algorithms import (
    ESTIMATORS,
    GPGEstimator,
    OPOEstimator,
    ReinforcePlusPlusBaselineEstimator,
    ReinforcePlusPlusEstimator,
    ReMaxEstimator,
    build_advantage_estimator,
    compute_advantages,
)
from cohort.data import PromptBatch
from cohort.rewards import RewardRunner
from cohort.rollout import collect_rollouts
from cohort.types import Completion, SamplingParams

NAN = float("nan")
NEW = ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg"]


def close(actual: torch.Tensor, expected: list[float], tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=1e-7)


def adv(rewards: list[float], g: int, estimator, **kw) -> torch.Tensor:
    return compute_advantages(torch.tensor(rewards, dtype=torch.float64), g, estimator=estimator, **kw).advantages


# -- the table ---------------------------------------------------------------------------------------
def test_the_new_estimators_are_in_the_table_by_name():
    expected = {"reinforce_plus_plus": ReinforcePlusPlusEstimator,
                "reinforce_plus_plus_baseline": ReinforcePlusPlusBaselineEstimator,
                "remax": ReMaxEstimator, "opo": OPOEstimator, "gpg": GPGEstimator}
    for name, cls in expected.items():
        assert ESTIMATORS[name] is cls and cls.name == name
        assert isinstance(build_advantage_estimator(name), cls)
    assert ReMaxEstimator.needs_greedy_baseline and not OPOEstimator.needs_greedy_baseline
    assert OPOEstimator.needs_lengths and ReinforcePlusPlusEstimator.needs_lengths
    assert not GPGEstimator.needs_lengths


def test_an_import_path_builds_a_parametrised_estimator():
    est = build_advantage_estimator("tests.unit.test_estimators_more:gpg_halved")
    assert isinstance(est, GPGEstimator) and est.f_norm == 2.0


def gpg_halved() -> GPGEstimator:
    return GPGEstimator(f_norm=2.0)


@pytest.mark.parametrize("name", NEW)
def test_no_normalize_then_sum_form(name):
    with pytest.raises(ValueError, match="normalize_then_sum"):
        compute_advantages(torch.zeros(4, 2), 2, estimator=name, multi_objective_aggregation="normalize_then_sum",
                           lengths=[1] * 4, baseline_rewards=torch.zeros(2, 2))


@pytest.mark.parametrize("name", NEW)
def test_scale_rewards_is_not_read_and_zero_std_is_the_group_std(name):
    r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]  # groups of 2: [1, 0], [0, 1], [1, 1] (the last all-equal)
    kw = {"lengths": [3, 1, 2, 2, 5, 1], "baseline_rewards": torch.tensor([1.0, 0.0, 0.5])}
    outs = [compute_advantages(torch.tensor(r), 2, estimator=name, scale_rewards=s, **kw)
            for s in ("group", "batch", "none")]
    for out in outs[1:]:
        torch.testing.assert_close(out.advantages, outs[0].advantages)
    assert outs[0].is_std_zero.tolist() == [False] * 4 + [True] * 2
    assert not torch.isnan(outs[0].advantages).any()


# -- REINFORCE++ ---------------------------------------------------------------------------------------
def test_reinforce_plus_plus_whitens_over_the_batch_by_tokens():
    # r = [1, 0, 0, 0] with 3, 1, 2, 2 tokens: w-sum 8, mean 3/8 = 0.375
    # var = (3 * 0.625^2 + 1 * 0.375^2 + 2 * 0.375^2 + 2 * 0.375^2) / (8 - 1)
    #     = (3 * 0.390625 + 5 * 0.140625) / 7 = (1.171875 + 0.703125) / 7 = 1.875 / 7 = 0.2678571
    s = math.sqrt(1.875 / 7 + 1e-8)  # = 0.5175492
    # the groups do not matter: no group baseline
    expected = [0.625 / s, -0.375 / s, -0.375 / s, -0.375 / s]
    close(adv([1, 0, 0, 0], 2, "reinforce_plus_plus", lengths=[3, 1, 2, 2]), expected)
    close(adv([1, 0, 0, 0], 4, "reinforce_plus_plus", lengths=[3, 1, 2, 2]), expected)


def test_reinforce_plus_plus_without_lengths_counts_rows_and_skips_nan():
    # no lengths: each row weight 1; [1, 0, 0, 0]: mean 0.25, var = (0.75^2 + 3 * 0.25^2) / 3 = 0.75 / 3 = 0.25
    s = math.sqrt(0.25 + 1e-8)
    est = ReinforcePlusPlusEstimator()
    a, _ = est.advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), 2, scale_rewards="group", eps=1e-4)
    close(a, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s])
    # a NaN row leaves the statistics: [nan, 1, 0, 0] is [1, 0, 0] -> mean 1/3, var = (4/9 + 2/9) / 2 = 1/3
    s = math.sqrt(1 / 3 + 1e-8)
    close(adv([NAN, 1, 0, 0], 2, "reinforce_plus_plus"), [0.0, (2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s])


def test_reinforce_plus_plus_baseline_centres_on_the_group_then_whitens():
    # groups [1, 0] and [1, 1]: centred [0.5, -0.5, 0, 0], mean 0, var = (0.25 + 0.25) / 3 = 1/6
    s = math.sqrt(1 / 6 + 1e-8)  # 0.4082483
    close(adv([1, 0, 1, 1], 2, "reinforce_plus_plus_baseline", lengths=[1, 1, 1, 1]), [0.5 / s, -0.5 / s, 0.0, 0.0])
    # token weights 2, 2, 1, 3: mean of the centred values (2 * 0.5 - 2 * 0.5 + 0 + 0) / 8 = 0
    # var = (2 * 0.25 + 2 * 0.25) / 7 = 1 / 7
    s = math.sqrt(1 / 7 + 1e-8)
    close(adv([1, 0, 1, 1], 2, "reinforce_plus_plus_baseline", lengths=[2, 2, 1, 3]), [0.5 / s, -0.5 / s, 0.0, 0.0])


def test_token_weighting_can_be_turned_off():
    # token_weighted=False: the lengths are ignored, rows count once: [1, 0, 0, 0] as in the row test above
    s = math.sqrt(0.25 + 1e-8)
    out = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 2, lengths=[3, 1, 2, 2],
                             estimator=ReinforcePlusPlusEstimator(token_weighted=False))
    close(out.advantages, [0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s], tol=1e-6)


# -- ReMax ---------------------------------------------------------------------------------------------
def test_remax_subtracts_the_greedy_reward():
    # groups [1, 0] (greedy 1) and [1, 1] (greedy 0): A = r - r_greedy = [0, -1, 1, 1]
    close(adv([1, 0, 1, 1], 2, "remax", baseline_rewards=torch.tensor([1.0, 0.0])), [0.0, -1.0, 1.0, 1.0])


def test_remax_combines_the_greedy_rewards_like_the_samples_and_nan_gives_zero():
    # two functions, weights 1 and 0.5: sample rows [1, 1] -> 1.5, [0, 1] -> 0.5, [0, 0] -> 0, [1, 0] -> 1
    # greedy of prompt 0: [1, 0] -> 1.0; of prompt 1: [nan, nan] (unscorable) -> its rows get A = 0
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    greedy = torch.tensor([[1.0, 0.0], [NAN, NAN]])
    out = compute_advantages(r, 2, estimator="remax", reward_weights=[1.0, 0.5], baseline_rewards=greedy)
    close(out.advantages, [0.5, -0.5, 0.0, 0.0])  # 1.5 - 1, 0.5 - 1, then 0, 0


def test_remax_without_greedy_rewards_says_what_is_missing():
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator="remax")
    with pytest.raises(ValueError, match="one row per prompt"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator="remax", baseline_rewards=torch.zeros(3))


# -- OPO -----------------------------------------------------------------------------------------------
def test_opo_baseline_is_length_weighted():
    # group [1, 0, 0, 0] with 10, 30, 20, 40 tokens: b = (10 * 1) / (10 + 30 + 20 + 40) = 0.1
    # A = r - 0.1 = [0.9, -0.1, -0.1, -0.1]  (GRPO's mean would be 0.25)
    close(adv([1, 0, 0, 0], 4, "opo", lengths=[10, 30, 20, 40]), [0.9, -0.1, -0.1, -0.1])
    # an unscorable row leaves the baseline: [nan, 1, 0, 0] with 50, 10, 30, 60 -> b = 10 / 100 = 0.1
    close(adv([NAN, 1, 0, 0], 4, "opo", lengths=[50, 10, 30, 60]), [0.0, 0.9, -0.1, -0.1])


def test_opo_without_lengths_says_so():
    with pytest.raises(ValueError, match="opo needs lengths"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator="opo")
    with pytest.raises(ValueError, match="lengths has 3 entries"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator="opo", lengths=[1, 2, 3])


# -- GPG -----------------------------------------------------------------------------------------------
def test_gpg_scales_by_the_share_of_nonzero_rewards():
    # groups [1, 0, 0] (mean 1/3) and [0, 1, 1] (mean 2/3): centred [2/3, -1/3, -1/3, -2/3, 1/3, 1/3]
    # N = 6 rows, M = 3 non-zero rewards: alpha = 6 / 3 = 2
    close(adv([1, 0, 0, 0, 1, 1], 3, "gpg"), [4 / 3, -2 / 3, -2 / 3, -4 / 3, 2 / 3, 2 / 3])
    # f_norm = 2 halves it
    close(adv([1, 0, 0, 0, 1, 1], 3, GPGEstimator(f_norm=2.0)), [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    # all rewards 0: M clamps to 1, every group centred at 0 -> A = 0
    close(adv([0, 0, 0, 0], 2, "gpg"), [0.0] * 4)


def test_gpg_rejects_a_bad_f_norm():
    with pytest.raises(ValueError, match="f_norm"):
        GPGEstimator(f_norm=0.0)


# -- verl, re-derived on token tensors -----------------------------------------------------------------
def token_tensors(scores: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's inputs: [B, T] token_level_rewards with the score on the last response token, and response_mask."""
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    for i, n in enumerate(lengths):
        rewards[i, n - 1] = scores[i]
    return rewards, mask


def verl_masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # torch_functional.py masked_whiten: masked mean, masked_var with Bessel n / (n - 1), rsqrt(var + 1e-8)
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * (n / (n - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def verl_group_means(scores: torch.Tensor, index: list[int]) -> torch.Tensor:
    # the id2score / id2mean loop: the mean of the group's scores (a group of one gets 0)
    out = torch.zeros_like(scores)
    for i, g in enumerate(index):
        members = scores[[j for j, h in enumerate(index) if h == g]]
        out[i] = members.mean() if members.numel() > 1 else 0.0
    return out


def verl_reinforce_plus_plus(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    # core_algos.py compute_reinforce_plus_plus_outcome_advantage: discounted returns reset after EOS,
    # masked_whiten over the response tokens, times the mask
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask


def verl_reinforce_plus_plus_baseline(token_rewards, mask, index) -> torch.Tensor:
    # core_algos.py compute_reinforce_plus_plus_baseline_outcome_advantage: scores - group mean, tiled over
    # the tokens, masked_whiten, times the mask
    scores = token_rewards.sum(dim=-1)
    centred = scores - verl_group_means(scores, index)
    tiled = centred.unsqueeze(-1).tile([1, token_rewards.shape[1]]) * mask
    return verl_masked_whiten(tiled, mask) * mask


def verl_remax(token_rewards, reward_baselines, mask) -> torch.Tensor:
    # core_algos.py compute_remax_outcome_advantage: reverse cumulative sum of the rewards minus the baseline
    returns = (token_rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.unsqueeze(-1) * mask


def verl_opo(token_rewards, mask, index) -> torch.Tensor:
    # core_algos.py compute_opo_outcome_advantage: baseline sum(len * score) / sum(len) per group
    scores, lengths = token_rewards.sum(dim=-1), mask.sum(dim=-1)
    out = torch.zeros_like(scores)
    for i, g in enumerate(index):
        members = [j for j, h in enumerate(index) if h == g]
        base = (lengths[members] * scores[members]).sum() / lengths[members].sum() if len(members) > 1 else 0.0
        out[i] = scores[i] - base
    return out.unsqueeze(-1) * mask


def verl_gpg(token_rewards, mask, index, f_norm: float = 1.0) -> torch.Tensor:
    # core_algos.py compute_gpg_outcome_advantage: alpha = bsz / count_nonzero(scores).clamp(min=1),
    # A = alpha * (score - group mean) / f_norm (the count taken in float64 here: int / int64 tensor would give
    # torch's default float32, a rounding difference, not a different formula)
    scores = token_rewards.sum(dim=-1)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).double()
    return (alpha * (scores - verl_group_means(scores, index)) / f_norm).unsqueeze(-1) * mask


def per_row(token_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The one advantage of each row: every response token of a row carries the same value."""
    first = token_adv[:, 0]
    assert torch.allclose(token_adv * mask, first.unsqueeze(-1) * mask, atol=1e-12)
    return first


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("binary", [True, False])
def test_every_estimator_matches_verl(seed, binary):
    gen = torch.Generator().manual_seed(seed)
    p, g = 4, 4
    scores = (torch.randint(0, 2, (p * g,), generator=gen) if binary else torch.rand(p * g, generator=gen)).double()
    lengths = torch.randint(1, 9, (p * g,), generator=gen).tolist()
    index = [i // g for i in range(p * g)]
    token_rewards, mask = token_tensors(scores, lengths)
    greedy = torch.rand(p, generator=gen).double()
    expected = {
        "reinforce_plus_plus": verl_reinforce_plus_plus(token_rewards, mask),
        "reinforce_plus_plus_baseline": verl_reinforce_plus_plus_baseline(token_rewards, mask, index),
        "remax": verl_remax(token_rewards, greedy.repeat_interleave(g), mask),
        "opo": verl_opo(token_rewards, mask, index),
        "gpg": verl_gpg(token_rewards, mask, index),
    }
    for name, token_adv in expected.items():
        got = compute_advantages(scores, g, estimator=name, lengths=lengths, baseline_rewards=greedy).advantages
        torch.testing.assert_close(got, per_row(token_adv, mask), atol=1e-9, rtol=1e-9, msg=name)
    got = compute_advantages(scores, g, estimator=GPGEstimator(f_norm=0.5)).advantages
    torch.testing.assert_close(got, per_row(verl_gpg(token_rewards, mask, index, f_norm=0.5), mask))


# -- the rollout: greedy baseline and lengths ----------------------------------------------------------
class RecordingEngine:
    """Prompt p's completion j is [p, j] (sampled) or [p, 7] (greedy); remembers every call's parameters."""

    def __init__(self):
        self.calls: list[SamplingParams] = []

    def generate(self, prompts, params):
        self.calls.append(params)
        last = 7 if params.temperature == 0.0 else None
        return [[Completion([p[0], j if last is None else last] + [0] * p[0], [0.0] * (2 + p[0]), "stop")
                 for j in range(params.n)] for p in prompts]

    def sync_weights(self):
        pass


def second_token(completion_ids, **kwargs):
    # the reward is the sample index j (greedy completions: 7 -> 0.5)
    return [0.5 if ids[1] == 7 else float(ids[1]) for ids in completion_ids]


def feeder():
    state = {"next": 0}

    def take(count):
        ids = list(range(state["next"], state["next"] + count))
        state["next"] += count
        return PromptBatch(prompts=[f"p{i}" for i in ids], prompt_ids=[[i] for i in ids], columns={}, indices=ids)
    return take


def rollout(estimator: str, **kw):
    engine = RecordingEngine()
    batch = collect_rollouts(engine, Tok(), feeder(), 2, SamplingParams(n=3, temperature=0.9),
                             RewardRunner([second_token]), trainer_state={},
                             advantage_kwargs={"scale_rewards": "group", "estimator": estimator}, **kw)
    return engine, batch


def test_remax_rollout_generates_one_greedy_completion_per_prompt_and_does_not_train_on_it():
    engine, batch = rollout("remax")
    assert [(c.n, c.temperature) for c in engine.calls] == [(3, 0.9), (1, 0.0)]
    assert len(batch) == 6 and all(ids[1] != 7 for ids in batch.completion_ids)
    # rewards j = 0, 1, 2 per prompt; greedy reward 0.5 -> A = [-0.5, 0.5, 1.5] for both prompts
    close(batch.advantages, [-0.5, 0.5, 1.5] * 2)
    assert batch.metrics["remax/greedy_reward"] == 0.5


def test_remax_rollout_with_dynamic_sampling_keeps_the_greedy_rewards_of_the_kept_groups():
    engine, batch = rollout("remax", dynamic_sampling=True)
    close(batch.advantages, [-0.5, 0.5, 1.5] * 2)
    assert [c.temperature for c in engine.calls] == [0.9, 0.0]


def test_other_estimators_generate_no_greedy_completion():
    engine, _ = rollout("grpo")
    assert [c.n for c in engine.calls] == [3]


def test_opo_rollout_passes_each_completions_trained_tokens():
    # prompt p's completions have 2 + p tokens: prompt 0 -> 2 each, prompt 1 -> 3 each; equal within a group,
    # so b = mean_g = 1 and A = [-1, 0, 1] for both prompts
    _, batch = rollout("opo")
    close(batch.advantages, [-1.0, 0.0, 1.0] * 2)


def test_opo_counts_only_the_models_tokens_of_a_multi_turn_completion():
    # mask [1, 0, 0, 1] -> 2 trained tokens; [1, 1, 1, 1] -> 4: b = (2 * 1 + 4 * 0) / 6 = 1/3
    class MaskedEngine(RecordingEngine):
        def generate(self, prompts, params):
            return [[Completion([p[0], 1, 2, 3], [0.0] * 4, "stop", mask=[1, 0, 0, 1]),
                     Completion([p[0], 0, 2, 3], [0.0] * 4, "stop", mask=[1, 1, 1, 1])] for p in prompts]

    batch = collect_rollouts(MaskedEngine(), Tok(), feeder(), 1, SamplingParams(n=2), RewardRunner([second_token]),
                             advantage_kwargs={"estimator": "opo"}, trainer_state={})
    close(batch.advantages, [2 / 3, -1 / 3])


def test_rollout_gathers_lengths_and_greedy_rewards_across_ranks():
    # a fake two-rank gather: this rank's rows twice (rank 0 and rank 1 hold equal data)
    def gather(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t])

    engine = RecordingEngine()
    batch = collect_rollouts(engine, Tok(), feeder(), 2, SamplingParams(n=3, temperature=0.9),
                             RewardRunner([second_token]), advantage_kwargs={"estimator": "remax"}, trainer_state={},
                             gather_rewards=gather, rank=1)
    close(batch.advantages, [-0.5, 0.5, 1.5] * 2)

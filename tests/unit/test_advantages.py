"""compute_advantages against numbers derived by hand (arithmetic in the comments)."""

import math
import statistics

import pytest
import torch

from cohort.algorithms import compute_advantages, nanstd

NAN = float("nan")
EPS = 1e-4


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-9, rtol=1e-7)


def test_group_scaling():
    # group [1, 0, 1, 0]: mean 0.5, Bessel var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    # A = +-0.5 / (0.5773503 + 1e-4)
    out = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    close(out.advantages, [a, -a, a, -a])
    close(out.group_mean, [0.5])
    close(out.group_std, [math.sqrt(1 / 3)])
    assert out.frac_reward_zero_std == 0.0


def test_all_equal_group_gives_zero_without_nan():
    # group 2 is [3, 3, 3]: std 0 -> A = 0 / (0 + 1e-4) = 0; group 1 [0, 1, 2]: mean 1, std 1 -> A = (-1, 0, 1)/1.0001
    out = compute_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0, 3.0, 3.0]), 3)
    assert not torch.isnan(out.advantages).any()
    close(out.advantages, [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0])
    assert out.is_std_zero.tolist() == [False] * 3 + [True] * 3
    assert out.frac_reward_zero_std == 0.5


def test_nan_rows_get_zero_and_leave_group_stats():
    # [nan, 1, 0, 0]: valid rows 1, 0, 0 -> mean 1/3; deviations 2/3, -1/3, -1/3
    # var = (4/9 + 1/9 + 1/9) / (3 - 1) = 1/3 -> std = 0.5773503; the NaN row gets A = 0
    out = compute_advantages(torch.tensor([NAN, 1.0, 0.0, 0.0]), 4)
    s = math.sqrt(1 / 3) + EPS
    close(out.advantages, [0.0, (2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s])
    close(out.group_mean, [1 / 3])
    assert math.isnan(out.rewards[0].item())


def test_group_with_one_scorable_row_is_zero():
    # [nan, nan, 5]: one valid row -> no baseline can be formed: A = 0 everywhere, std NaN (fewer than 2 rows)
    out = compute_advantages(torch.tensor([NAN, NAN, 5.0, NAN, NAN, NAN]), 3)
    close(out.advantages, [0.0] * 6)
    assert torch.isnan(out.group_std).all()


def test_batch_scaling():
    # groups [1, 0] and [3, 3]: centred by group mean -> [0.5, -0.5, 0, 0]
    # batch std of [1, 0, 3, 3]: mean 1.75; squares 0.5625 + 3.0625 + 1.5625 + 1.5625 = 6.75; /3 = 2.25 -> 1.5
    out = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale_rewards="batch")
    close(out.advantages, [0.5 / (1.5 + EPS), -0.5 / (1.5 + EPS), 0.0, 0.0])
    assert not out.is_std_zero.any()  # the batch std (1.5) scaled every row


def test_no_scaling_dr_grpo():
    # centred only: [1 - 0.5, 0 - 0.5, 3 - 3, 3 - 3]; group stds sqrt(0.5) and 0 -> zero-std mask [F, F, T, T]
    out = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), 2, scale_rewards="none")
    close(out.advantages, [0.5, -0.5, 0.0, 0.0])
    assert out.is_std_zero.tolist() == [False, False, True, True]


def test_rloo_leave_one_out():
    # [3, 0, 0]: baselines (0+0)/2 = 0, (3+0)/2 = 1.5, 1.5 -> A = [3, -1.5, -1.5] = 3/2 * (r - mean 1)
    out = compute_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, estimator="rloo", scale_rewards="none")
    close(out.advantages, [3.0, -1.5, -1.5])
    # with scaling: divided by the group std sqrt(((2)^2 + 1 + 1) / 2) = sqrt(3)
    out = compute_advantages(torch.tensor([3.0, 0.0, 0.0]), 3, estimator="rloo")
    s = math.sqrt(3) + EPS
    close(out.advantages, [3.0 / s, -1.5 / s, -1.5 / s])


def test_rloo_skips_nan_rows():
    # [3, nan, 0, 1]: valid sum 4 over 3 rows; baselines (4-3)/2 = 0.5, (4-0)/2 = 2, (4-1)/2 = 1.5
    out = compute_advantages(torch.tensor([3.0, NAN, 0.0, 1.0]), 4, estimator="rloo", scale_rewards="none")
    close(out.advantages, [2.5, 0.0, -2.0, -0.5])


def test_weighted_sum_then_normalize():
    # weights (2, 0.5): row sums 2*1 = 2, 0.5*1 = 0.5, unscorable, 2 + 0.5 = 2.5 (NaN entries skipped by nansum)
    # valid mean 5/3; deviations 1/3, -7/6, 5/6; var = (4 + 49 + 25)/36 / 2 = 13/12
    rewards = torch.tensor([[1.0, NAN], [NAN, 1.0], [NAN, NAN], [1.0, 1.0]])
    out = compute_advantages(rewards, 4, reward_weights=[2.0, 0.5])
    s = math.sqrt(13 / 12) + EPS
    close(out.rewards[[0, 1, 3]], [2.0, 0.5, 2.5])
    close(out.advantages, [(1 / 3) / s, (-7 / 6) / s, 0.0, (5 / 6) / s])


def test_normalize_then_sum_matches_step_by_step():
    # GDPO: normalise each function within its group, weighted sum, then normalise over the batch.
    f1 = [1.0, 0.0, 0.0, 2.0, 2.0, 5.0]
    f2 = [0.0, 3.0, 1.0, 1.0, 0.0, 1.0]
    w = (1.0, 0.5)
    combined = []
    for g in range(2):
        cols = []
        for f in (f1, f2):
            grp = f[3 * g: 3 * g + 3]
            m, s = statistics.mean(grp), statistics.stdev(grp)
            cols.append([(x - m) / (s + EPS) for x in grp])
        combined += [w[0] * a + w[1] * b for a, b in zip(*cols)]
    m, s = statistics.mean(combined), statistics.stdev(combined)
    expected = [(x - m) / (s + EPS) for x in combined]
    rewards = torch.tensor([f1, f2], dtype=torch.float64).T
    out = compute_advantages(rewards, 3, reward_weights=w, multi_objective_aggregation="normalize_then_sum")
    close(out.advantages, expected)
    close(out.rewards, combined)


def test_single_function_2d_equals_1d():
    r = torch.tensor([0.2, 0.9, 0.4, 0.4, 1.0, 0.0])
    torch.testing.assert_close(compute_advantages(r, 3).advantages, compute_advantages(r[:, None], 3).advantages)


def test_float64_kept():
    out = compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2)
    assert out.advantages.dtype == torch.float64


def test_group_of_one_rejected_with_clear_error():
    with pytest.raises(ValueError, match=r"num_generations=1.*set num_generations >= 2"):
        compute_advantages(torch.tensor([1.0, 0.0]), 1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"scale_rewards": "groups"}, "scale_rewards='groups'"),
    ({"estimator": "ppo"}, "estimator='ppo'"),
    ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation='mean'"),
    ({"reward_weights": [1.0, 2.0]}, "reward_weights has 2 entries"),
])
def test_bad_options_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, **kwargs)


def test_rows_not_multiple_of_group():
    with pytest.raises(ValueError, match="not a multiple of num_generations=2"):
        compute_advantages(torch.tensor([1.0, 0.0, 1.0]), 2)


def test_nanstd_bessel():
    # [1, 2, nan, 4]: mean 7/3; squares 16/9 + 1/9 + 25/9 = 42/9; / 2 = 7/3
    assert nanstd(torch.tensor([1.0, 2.0, NAN, 4.0])).item() == pytest.approx(math.sqrt(7 / 3))


def test_trl_boolean_scale_rewards():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    torch.testing.assert_close(compute_advantages(r, 2, scale_rewards=False).advantages,
                               compute_advantages(r, 2, scale_rewards="none").advantages)
    torch.testing.assert_close(compute_advantages(r, 2, scale_rewards=True).advantages,
                               compute_advantages(r, 2, scale_rewards="group").advantages)

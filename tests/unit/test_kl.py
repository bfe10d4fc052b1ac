"""KL estimators: values and gradients by hand, d = logp - ref_logp."""

import math

import pytest
import torch

from cohort.algorithms import KL_ESTIMATORS, kl_penalty

LN2 = math.log(2.0)


def value_and_grad(estimator: str, d: float) -> tuple[float, float]:
    logp = torch.tensor([d], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(logp, torch.zeros(1, dtype=torch.float64), estimator)
    kl.sum().backward()
    return kl.item(), logp.grad.item()


# (estimator, d, value, d value / d logp)
CASES = [
    ("k1", LN2, LN2, 1.0),                               # d
    ("kl", -LN2, -LN2, 1.0),
    ("k2", LN2, 0.5 * LN2**2, LN2),                      # d^2/2 = 0.2402265; grad d
    ("mse", -LN2, 0.5 * LN2**2, -LN2),
    ("k3", LN2, 0.5 + LN2 - 1, 1 - 0.5),                 # exp(-d) + d - 1 = 0.1931472; grad 1 - exp(-d)
    ("k3", -LN2, 2 - LN2 - 1, 1 - 2),                    # 0.3068528; grad -1
    ("abs", -LN2, LN2, -1.0),                            # |d|; grad sign(d)
    ("low_var_kl", LN2, 0.5 + LN2 - 1, 0.5),             # equals k3 inside the clamps
    ("k3+", LN2, 0.5 + LN2 - 1, LN2),                    # straight-through: k3 value, k2 gradient d
    ("k3+", -LN2, 2 - LN2 - 1, -LN2),
    ("k1+", LN2, LN2, LN2),                              # k1 value, k2 gradient
    ("kl+", 0.3, 0.3, 0.3),
    ("abs+", -0.3, 0.3, -0.3),
    ("k2+", 0.3, 0.045, 0.3),                            # k2 is already its own straight-through
    ("low_var_kl+", LN2, 0.5 + LN2 - 1, LN2),
]


@pytest.mark.parametrize(("estimator", "d", "value", "grad"), CASES)
def test_value_and_gradient(estimator, d, value, grad):
    v, g = value_and_grad(estimator, d)
    assert v == pytest.approx(value, abs=1e-12)
    assert g == pytest.approx(grad, abs=1e-12)


def test_low_var_kl_is_clamped_like_verl():
    # d = -30: k3 = exp(30) - 30 - 1 ~ 1.07e13; verl clamps -d to 20 then the value to 10
    assert value_and_grad("low_var_kl", -30.0)[0] == 10.0
    assert value_and_grad("k3", -30.0)[0] == pytest.approx(math.exp(30) - 31)


def test_shape_kept_and_every_name_accepted():
    logp, ref = torch.randn(3, 4), torch.randn(3, 4)
    for name in KL_ESTIMATORS:
        assert kl_penalty(logp, ref, name).shape == (3, 4)


def test_k3_nonnegative_and_zero_at_equality():
    logp = torch.randn(100, dtype=torch.float64)
    assert (kl_penalty(logp, torch.randn(100, dtype=torch.float64), "k3") >= 0).all()
    assert kl_penalty(logp, logp, "k3").abs().max().item() == 0.0


def test_unknown_estimator():
    with pytest.raises(ValueError, match="kl estimator='k4'"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")

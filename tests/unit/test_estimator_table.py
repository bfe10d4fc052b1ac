"""The advantage-estimator table: built-ins against numbers derived by hand, a user estimator by import path,
clear errors for an unknown name, and the one error shape of the import-path resolver."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from cohort.algorithms import (
    ESTIMATORS,
    AdvantageEstimator,
    GRPOEstimator,
    RLOOEstimator,
    build_advantage_estimator,
    compute_advantages,
)
from cohort.algorithms.baselines import (
    GPGEstimator,
    OPOEstimator,
    ReinforcePlusPlusBaselineEstimator,
    ReinforcePlusPlusEstimator,
    ReMaxEstimator,
)
from cohort.errors import ConfigError
from cohort.resolve import resolve_object

EPS = 1e-4
HERE = "tests.unit.test_estimator_table"


@dataclass
class MyEstimator(AdvantageEstimator):
    """A user estimator: the group's best reward is the baseline, A = r - max_g (then the usual scaling)."""

    name: ClassVar[str] = "max_baseline"

    def baseline(self, grouped: torch.Tensor) -> torch.Tensor:
        return torch.amax(grouped, dim=1, keepdim=True)


def make_my_estimator() -> MyEstimator:
    """A zero-argument factory, the other thing an import path may name."""
    return MyEstimator()


def not_an_estimator() -> int:
    return 3


def close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=1e-6, rtol=1e-6)


def test_the_table_names_the_built_ins():
    assert dict(ESTIMATORS) == {"grpo": GRPOEstimator, "rloo": RLOOEstimator,
                                "reinforce_plus_plus": ReinforcePlusPlusEstimator,
                                "reinforce_plus_plus_baseline": ReinforcePlusPlusBaselineEstimator,
                                "remax": ReMaxEstimator, "opo": OPOEstimator, "gpg": GPGEstimator}
    assert all(cls.name == name for name, cls in ESTIMATORS.items())
    assert isinstance(build_advantage_estimator("rloo"), RLOOEstimator)
    est = RLOOEstimator()
    assert build_advantage_estimator(est) is est


def test_grpo_through_the_table():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # one group of 4: mean 0.5, deviations +-0.5, squares 4 * 0.25 = 1, Bessel var 1 / 3, std sqrt(1/3) = 0.57735
    std = math.sqrt(1 / 3)
    a = 0.5 / (std + EPS)  # = 0.86588 (0.5 / 0.57745)
    adv, scaling_std = ESTIMATORS["grpo"]().advantages(r, 4, scale_rewards="group", eps=EPS)
    close(adv, [a, -a, -a, a])
    close(scaling_std, [std] * 4)
    out = compute_advantages(r, 4, estimator="grpo")
    close(out.advantages, [a, -a, -a, a])
    # no scaling (Dr. GRPO): A = r - 0.5
    close(ESTIMATORS["grpo"]().advantages(r, 4, scale_rewards="none", eps=EPS)[0], [0.5, -0.5, -0.5, 0.5])


def test_rloo_through_the_table():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # leave-one-out baseline: for a 1 the others are 0, 0, 1 -> 1/3, A = 1 - 1/3 = 2/3;
    # for a 0 the others are 1, 0, 1 -> 2/3, A = 0 - 2/3 = -2/3  (= 4/3 * (r - 0.5), n/(n-1) times GRPO's)
    close(ESTIMATORS["rloo"]().advantages(r, 4, scale_rewards="none", eps=EPS)[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # group scaling divides by the same std as GRPO: (2/3) / (sqrt(1/3) + 1e-4) = 1.15450
    a = (2 / 3) / (math.sqrt(1 / 3) + EPS)
    close(compute_advantages(r, 4, estimator="rloo").advantages, [a, -a, -a, a])


def test_user_estimator_by_import_path():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])
    # group 1: max 1 -> A = r - 1 = [0, -1, -1, 0]; group 2: max 3 -> A = [0, -2, -1, -1]
    for path in (f"{HERE}:MyEstimator", f"{HERE}:make_my_estimator"):
        est = build_advantage_estimator(path)
        assert type(est).__name__ == "MyEstimator" and est.name == "max_baseline"
        out = compute_advantages(r, 4, estimator=path, scale_rewards="none")
        close(out.advantages, [0.0, -1.0, -1.0, 0.0, 0.0, -2.0, -1.0, -1.0])
    # with group scaling: group 1 std sqrt(1/3); group 2 mean 2, squares 1 + 1 + 0 + 0 = 2, var 2/3
    s1, s2 = math.sqrt(1 / 3) + EPS, math.sqrt(2 / 3) + EPS
    out = compute_advantages(r, 4, estimator=f"{HERE}:MyEstimator")
    close(out.advantages, [0.0, -1 / s1, -1 / s1, 0.0, 0.0, -2 / s2, -1 / s2, -1 / s2])


def test_user_estimator_has_no_normalize_then_sum_form():
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match=r"estimator='tests.unit.test_estimator_table:MyEstimator' with "
                                         r"multi_objective_aggregation='normalize_then_sum' is not defined"):
        compute_advantages(r, 2, estimator=f"{HERE}:MyEstimator", multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match=r"not leave-one-out\)\. Fix: use multi_objective_aggregation="
                                         r"'sum_then_normalize' with rloo"):
        compute_advantages(r, 2, estimator="rloo", multi_objective_aggregation="normalize_then_sum")


@pytest.mark.parametrize("call", [build_advantage_estimator,
                                  lambda name: compute_advantages(torch.tensor([1.0, 0.0]), 2, estimator=name)])
def test_unknown_name_names_the_value_and_the_choices(call):
    with pytest.raises(ConfigError) as info:
        call("rlooo")
    message = str(info.value)
    assert "estimator='rlooo'" in message
    assert "Did you mean 'rloo'?" in message
    assert "grpo, rloo" in message and "package.module:EstimatorClass" in message


def test_import_path_that_builds_no_estimator():
    with pytest.raises(TypeError, match=r"built a int, not an advantage estimator"):
        build_advantage_estimator(f"{HERE}:not_an_estimator")
    with pytest.raises(ConfigError, match=r"has no attribute 'Nope'"):
        build_advantage_estimator(f"{HERE}:Nope")


@pytest.mark.parametrize(("spec", "problem"), [
    ("no_such_module_xyz:Thing", r"Cannot import module 'no_such_module_xyz' \(.*\)\. Is it on PYTHONPATH\?"),
    (f"{HERE}:Nope", rf"Module '{HERE}' has no attribute 'Nope'\."),
    (f"{HERE}.MyEstimator", r"not an import path \(no ':' between the module and the name\)\."),
])
def test_resolver_has_one_error_shape(spec, problem):
    with pytest.raises(ConfigError) as info:
        resolve_object(spec, field="advantage.estimator", expects="EstimatorClass")
    # <field> '<spec>': <problem> Fix: <fix>, the same for all three ways to fail
    shape = (rf"advantage\.estimator {re.escape(repr(spec))}: {problem} "
             r"Fix: write it as 'package\.module:EstimatorClass', with the module importable \(on PYTHONPATH\)\.")
    assert re.fullmatch(shape, str(info.value)), str(info.value)
    assert isinstance(info.value, ValueError)  # a ConfigError is a ValueError: old `except ValueError` still works


def test_resolver_follows_dotted_names_and_takes_a_fix():
    # pytest may import this file under another module name, so compare names, not objects
    assert resolve_object(f"{HERE}:MyEstimator.baseline").__qualname__ == "MyEstimator.baseline"
    with pytest.raises(ConfigError, match=r"^x 'nocolon': not an import path .* Fix: see the docs\.$"):
        resolve_object("nocolon", field="x", fix="see the docs.")

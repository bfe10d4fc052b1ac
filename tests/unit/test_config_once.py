"""Validation runs once per run, not once per caller (issue 32): `CohortConfig.validate()` on a config that is
unchanged since it last passed returns at once; any change validates again, and a bad change still fails."""

from __future__ import annotations

import dataclasses

import pytest

from cohort.config import CohortConfig, load_config, validation
from cohort.errors import ConfigError


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """Counts the full validations (check_inputs is their last step) while still running them."""
    seen: list[int] = []
    original = validation.check_inputs

    def counting(cfg):
        seen.append(1)
        original(cfg)

    monkeypatch.setattr(validation, "check_inputs", counting)
    return seen


def test_the_same_config_is_validated_once(calls):
    cfg = load_config(None, ["train.max_steps=3"])
    cfg.validate()
    cfg.validate()
    assert len(calls) == 1


def test_a_changed_field_is_validated_again(calls):
    cfg = load_config(None, ["train.max_steps=3"]).validate()
    cfg.train.max_steps = 4
    cfg.validate()
    assert len(calls) == 2
    cfg.validate()
    assert len(calls) == 2
    cfg.train.max_steps = 4.0  # equal, but another type: checked again
    cfg.validate()
    assert len(calls) == 3


def test_a_bad_change_still_raises_every_time(calls):
    cfg = load_config(None).validate()
    cfg.train.max_steps = 0
    for _ in range(2):
        with pytest.raises(ConfigError, match=r"train\.max_steps=0"):
            cfg.validate()
    cfg.train.max_steps = 2
    cfg.validate()


def test_a_change_inside_a_mapping_or_list_is_seen(calls):
    cfg = load_config(None).validate()
    cfg.loss.params["epsilonn"] = 0.3  # an unknown loss parameter, in the mapping the config already held
    with pytest.raises(ConfigError, match="epsilonn"):
        cfg.validate()
    del cfg.loss.params["epsilonn"]
    cfg.validate()
    cfg.reward.funcs.append("no_such_reward")
    with pytest.raises(ConfigError, match="no_such_reward"):
        cfg.validate()


def test_another_object_with_the_same_name_is_validated_again(calls):
    cfg = CohortConfig()
    cfg.reward.funcs = [lambda completions, **kw: [0.0] * len(completions)]
    cfg.validate()
    cfg.reward.funcs = [lambda completions, **kw: [1.0] * len(completions)]  # to_dict() reads the same
    cfg.validate()
    assert len(calls) == 2


def test_the_fingerprint_is_no_field():
    cfg = load_config(None).validate()
    assert [f.name for f in dataclasses.fields(cfg)] == [f.name for f in dataclasses.fields(CohortConfig())]
    assert cfg.to_dict() == CohortConfig().to_dict()
    assert cfg == CohortConfig()

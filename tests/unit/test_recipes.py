"""Every shipped recipe loads and passes validation (names of losses, fields and rewards included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cohort.config import load_config
from cohort.rewards import get_reward_function

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_is_valid(recipe):
    if "reasoning_gym" in recipe.read_text():
        pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")
    cfg = load_config(recipe)
    for spec in cfg.reward.funcs:
        name, kwargs = next(iter(spec.items())) if isinstance(spec, dict) else (spec, {})
        get_reward_function(name, **(kwargs or {}))


def test_there_are_recipes():
    assert {"default", "chain_sum_gpu", "gsm8k_eval"} <= {r.stem for r in RECIPES}

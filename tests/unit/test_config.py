"""Config: YAML recipes, dotted overrides, "did you mean", cross-field validation."""

from __future__ import annotations

import pytest

from cohort.config import CohortConfig, apply_overrides, dump_config, load_config
from cohort.errors import ConfigError


def test_recipe_and_overrides(tmp_path):
    pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")  # the default data.source
    recipe = tmp_path / "r.yaml"
    recipe.write_text("generation:\n  num_generations: 4\ntrain:\n  prompts_per_step: 8\n")
    cfg = load_config(recipe, ["loss.epsilon=0.3", "train.learning_rate=2e-6", "data.options.min_terms=2",
                               "max_completion_length=64", "loss.sapo_temperature_neg=1.1",
                               "loss.loss_type=sapo", "loss.epsilon=null"])
    assert cfg.generation.num_generations == 4 and cfg.train.prompts_per_step == 8
    assert cfg.train.learning_rate == 2e-6 and cfg.data.options == {"min_terms": 2}
    assert cfg.generation.max_completion_length == 64  # a bare field name unique across sections
    assert cfg.loss.loss_params() == {"sapo_temperature_neg": 1.1}


@pytest.mark.parametrize("override, fragment", [
    ("train.learnig_rate=1", "Did you mean 'learning_rate'"),
    ("trian.max_steps=1", "Did you mean 'train.max_steps'"),
    ("generation.num_generations=1", "generation.num_generations=1"),
    ("loss.loss_type=nope", "nope"),
    ("noequals", "section.field=value"),
    ("model.lora_target_modules=[q_proj,lm_head]", "leave lm_head out"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, [override, "model.lora_r=8"] if "lora" in override else [override])
    assert fragment in str(info.value)


def test_missing_recipe_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such/recipe.yaml")


def test_dump_round_trips(tmp_path):
    pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25")  # the default data.source
    cfg = apply_overrides(CohortConfig(), ["loss.loss_type=cispo", "train.max_steps=7"])
    recipe = tmp_path / "dump.yaml"
    recipe.write_text(dump_config(cfg))
    again = load_config(recipe)
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("key", ["reward.max_oversample=0", "reward.max_resample_tries=0"])
def test_resampling_bounds_are_checked(key):
    with pytest.raises(ConfigError, match=key.split("=")[0].replace(".", r"\.")):
        apply_overrides(CohortConfig(), [key]).validate()

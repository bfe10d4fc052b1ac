"""The config documents itself: every field carries its help text, `cohort train --help-config` prints them,
docs/settings.md is generated from them, and "did you mean" quotes them (issue 32)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from cohort.cli import main
from cohort.config import CohortConfig, load_config
from cohort.config.help import REGENERATE, field_rows, render_markdown, render_text
from cohort.config.tree import section_types
from cohort.errors import ConfigError

SETTINGS_MD = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_docs_settings_md_is_generated_from_the_fields():
    assert SETTINGS_MD.is_file(), f"docs/settings.md is missing; write it with `{REGENERATE}`"
    assert SETTINGS_MD.read_text(encoding="utf-8") == render_markdown(), (
        f"docs/settings.md is out of date with src/cohort/config/sections.py; regenerate it with `{REGENERATE}`")


def test_every_field_of_every_section_has_a_help_text():
    missing = [f"{name}.{f.name}" for name, cls in section_types().items() for f in dataclasses.fields(cls)
               if not str(f.metadata.get("help", "")).strip()]
    assert not missing, f"fields without a help text (give them setting(..., help=...)): {missing}"


def test_rows_follow_the_dataclass_fields_in_order():
    rows = field_rows()
    expected = [f"{name}.{f.name}" for name, cls in section_types().items() for f in dataclasses.fields(cls)]
    assert [r.key for r in rows] == expected
    by_key = {r.key: r for r in rows}
    assert by_key["train.max_steps"].type == "int" and by_key["train.max_steps"].default == "100"
    assert by_key["loss.beta"].default == "null" and by_key["model.gradient_checkpointing"].default == "false"
    assert {r.section for r in field_rows("loss")} == {"loss"} and field_rows("loss")[0].name == "loss_type"


def test_the_defaults_shown_are_the_dataclasses_defaults():
    """The default column is what a recipe would write for CohortConfig()'s own values."""
    values = CohortConfig().to_dict()
    for r in field_rows():
        assert yaml.safe_load(r.default) == values[r.section][r.name], r.key


def test_help_config_prints_one_section(capsys):
    code = main(["train", "--help-config", "loss"])
    out = capsys.readouterr().out
    assert code == 0
    assert "loss.epsilon" in out and "lower clip range" in out
    assert "train.max_steps" not in out  # only the section asked for


def test_help_config_prints_every_section_and_reads_no_recipe(capsys):
    code = main(["train", "/no/such/recipe.yaml", "--help-config"])
    out = capsys.readouterr().out
    assert code == 0
    for name in section_types():
        assert f"[{name}]" in out
    assert out == render_text()


def test_help_config_unknown_section_says_did_you_mean(capsys):
    code = main(["train", "--help-config", "los"])
    err = capsys.readouterr().err
    assert code != 0
    assert "'los'" in err and "did you mean 'loss'?" in err and "generation" in err and "Traceback" not in err


def test_unknown_key_quotes_the_suggested_fields_help():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.learnig_rate=1e-6"])
    help_text = next(r.help for r in field_rows("train") if r.name == "learning_rate")
    assert "Did you mean 'learning_rate'?" in str(info.value)
    assert f"train.learning_rate: {help_text}" in str(info.value)
    with pytest.raises(ConfigError, match=r"Did you mean 'train\.max_steps'\? train\.max_steps: "):
        load_config(None, ["trian.max_steps=3"])

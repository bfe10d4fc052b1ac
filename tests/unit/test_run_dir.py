"""Run directory: refusing to reuse, safe overwrite, the failure guard, atomic resolved config."""

from pathlib import Path

import pytest
import yaml

from cohort.errors import ConfigError
from cohort.run_dir import (
    atomic_write_text,
    open_run_dir,
    prepare_run_dir,
    run_dir_guard,
    write_resolved_config,
)


def make_run(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("a: 1\n")
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    return path


def test_new_and_empty_dirs_are_created(tmp_path):
    assert prepare_run_dir(tmp_path / "a" / "b", resume=False, overwrite=False).is_dir()
    (tmp_path / "empty").mkdir()
    assert prepare_run_dir(tmp_path / "empty", resume=False, overwrite=False) == tmp_path / "empty"


def test_non_empty_dir_is_refused_with_the_fix(tmp_path):
    run = make_run(tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        prepare_run_dir(run, resume=False, overwrite=False)
    message = str(info.value)
    assert (
        str(run) in message and "--resume" in message and "--overwrite" in message and "output_dir" in message
    )
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


def test_resume_keeps_and_overwrite_clears(tmp_path):
    run = make_run(tmp_path / "run")
    assert prepare_run_dir(run, resume=True, overwrite=False) == run
    assert (run / "config.yaml").is_file()
    prepare_run_dir(run, resume=False, overwrite=True)
    assert run.is_dir() and list(run.iterdir()) == []
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no trash left behind
    with pytest.raises(ConfigError, match="choose one"):
        prepare_run_dir(run, resume=True, overwrite=True)


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(ConfigError, match="does not look like a cohort run"):
        prepare_run_dir(home, resume=False, overwrite=True)
    assert (home / "thesis.tex").read_text() == "precious"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_run_dir(tmp_path / "file", resume=False, overwrite=False)


def test_guard_removes_only_a_dir_it_created_and_without_progress(tmp_path):
    created = tmp_path / "new"
    with pytest.raises(RuntimeError), open_run_dir(created, resume=False, overwrite=False) as run:
        write_resolved_config(run, {"lr": 1e-6})
        raise RuntimeError("bad reward function")
    assert not created.exists()

    existing = make_run(tmp_path / "old")
    with pytest.raises(RuntimeError), open_run_dir(existing, resume=True, overwrite=False):
        raise RuntimeError("boom")
    assert (existing / "config.yaml").is_file()  # resumed: not ours to delete

    with pytest.raises(RuntimeError), run_dir_guard(tmp_path / "progress", created=True) as run:
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        raise RuntimeError("crash at step 2")
    assert (tmp_path / "progress" / "metrics.jsonl").is_file()  # it logged metrics: kept

    (tmp_path / "users").mkdir()
    with pytest.raises(RuntimeError), open_run_dir(tmp_path / "users", resume=False, overwrite=False):
        raise RuntimeError("boom")
    assert (tmp_path / "users").is_dir()  # the user's own empty dir stays

    with open_run_dir(tmp_path / "ok", resume=False, overwrite=False):
        pass
    assert (tmp_path / "ok").is_dir()  # no exception: kept


def test_guard_keeps_a_run_with_a_checkpoint(tmp_path):
    run = tmp_path / "r"
    with pytest.raises(KeyboardInterrupt), run_dir_guard(run, created=True):
        step_dir = run / "checkpoints" / "step-000001"
        step_dir.mkdir(parents=True)
        (step_dir / "trainer_state.json").write_text("{}")
        raise KeyboardInterrupt
    assert run.is_dir()


def test_write_resolved_config_round_trips_and_rejects_objects(tmp_path):
    import enum

    class Mode(enum.Enum):
        FAST = "fast"

    config = {
        "model": {"path": tmp_path / "m", "dtype": "bf16"},
        "loss": {"epsilon": 0.2, "betas": (0.9, 0.99)},
        "mode": Mode.FAST,
        "reward_weights": None,
    }
    path = write_resolved_config(tmp_path, config)
    assert path == tmp_path / "config.yaml"
    assert yaml.safe_load(path.read_text()) == {
        "model": {"path": str(tmp_path / "m"), "dtype": "bf16"},
        "loss": {"epsilon": 0.2, "betas": [0.9, 0.99]},
        "mode": "fast",
        "reward_weights": None,
    }
    assert list(yaml.safe_load(path.read_text())) == ["model", "loss", "mode", "reward_weights"]
    with pytest.raises(ConfigError, match=r"loss\.fn"):
        write_resolved_config(tmp_path, {"loss": {"fn": object()}})
    assert yaml.safe_load(path.read_text())["mode"] == "fast"  # the failed write left the old file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # and no temporary


def test_atomic_write_text_leaves_no_temporary_on_failure(tmp_path, monkeypatch):
    target = atomic_write_text(tmp_path / "x.txt", "one")
    import cohort.run_dir as rd

    def boom(*a):
        raise OSError("simulated")

    monkeypatch.setattr(rd.os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(target, "two")
    assert target.read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]

"""Run directory: refusing to reuse, safe overwrite, the failure guard, atomic resolved config."""

from pathlib import Path

import pytest
import yaml

from cohort.errors import ConfigError
from cohort.run.directory import (
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
    import cohort.run.directory as rd

    def boom(*a):
        raise OSError("simulated")

    monkeypatch.setattr(rd.os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(target, "two")
    assert target.read_text() == "one"
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_crash_and_resume_flow_keeps_files_consistent(tmp_path):
    """The sequence the trainer runs: new run, metrics + checkpoint, crash, --resume from the checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cohort.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
    from cohort.run.logging import MetricLogger, read_jsonl

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )
    model = LlamaForCausalLM(config)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError), open_run_dir(run, resume=False, overwrite=False) as run_dir:
        write_resolved_config(run_dir, {"max_steps": 4})
        logger = MetricLogger(run_dir, total_steps=4, report_to="jsonl")
        for step in (1, 2, 3):
            logger.log(step, {"reward": float(step)})
            if step == 2:
                save_checkpoint(run_dir, step, model=model, trainer_state={"data_position": 16})
        logger.close()
        raise RuntimeError("killed during step 4")
    assert run.is_dir()  # it made progress: kept for --resume

    with pytest.raises(ConfigError):
        prepare_run_dir(run, resume=False, overwrite=False)
    with open_run_dir(run, resume=True, overwrite=False) as run_dir:
        state = load_checkpoint(latest_checkpoint(run_dir), model=LlamaForCausalLM(config))
        assert state["step"] == 2 and state["data_position"] == 16
        with MetricLogger(run_dir, total_steps=4, report_to="jsonl", start_step=state["step"]) as logger:
            for step in (3, 4):
                logger.log(step, {"reward": 10.0 * step})
    assert [(r["step"], r["reward"]) for r in read_jsonl(run / "metrics.jsonl")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]
    assert torch.equal(
        model.lm_head.weight, LlamaForCausalLM.from_pretrained(latest_checkpoint(run)).lm_head.weight
    )


def test_open_run_dir_holds_the_lock_through_overwrite_and_removes_it_at_the_end(tmp_path):
    from cohort.errors import RunDirInUseError

    run = make_run(tmp_path / "run")
    with open_run_dir(run, resume=False, overwrite=True) as run_dir:
        assert sorted(p.name for p in run_dir.iterdir()) == [".cohort.lock"]  # the old run gone, the lock kept
        with pytest.raises(RunDirInUseError, match="in use by another cohort run"), open_run_dir(
                run, resume=True, overwrite=False):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no trash, no half-made folder left behind
    assert list(run.iterdir()) == []  # the lock file goes with the run


def test_a_refused_open_leaves_the_directory_as_it_was(tmp_path):
    run = make_run(tmp_path / "run")
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(ConfigError, match="already exists and is not empty"), open_run_dir(
            run, resume=False, overwrite=False):
        pass
    assert sorted(p.name for p in run.iterdir()) == before  # no lock file left
    with pytest.raises(ConfigError, match="choose one"), open_run_dir(tmp_path / "new", resume=True, overwrite=True):
        pass
    assert not (tmp_path / "new").exists()

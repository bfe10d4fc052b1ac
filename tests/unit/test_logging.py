"""MetricLogger: JSONL content, resume without duplicate steps, console lines, TensorBoard, sink selection."""

import io
import json
import sys
import types

import numpy as np
import pytest
import torch

from cohort.errors import ConfigError
from cohort.run.logging import MetricLogger, read_jsonl, resolve_report_to, truncate_jsonl


def test_jsonl_rows_hold_step_time_and_every_metric(tmp_path):
    with MetricLogger(tmp_path, total_steps=3, report_to=["jsonl"]) as logger:
        logger.log(1, {"reward": 0.5, "kl": torch.tensor(0.25), "entropy": np.float32(1.5), "num_tokens": 10})
        logger.log(2, {"reward": float("nan"), "completions/mean_length": 12.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # strict JSON: NaN became null
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward"] == 0.5 and rows[0]["kl"] == 0.25 and rows[0]["entropy"] == 1.5
    assert rows[0]["num_tokens"] == 10 and isinstance(rows[0]["num_tokens"], int)
    assert rows[1]["reward"] is None and rows[1]["completions/mean_length"] == 12.0
    assert rows[0]["time"] > 1e9


def test_resume_drops_later_rows_so_no_step_is_duplicated(tmp_path):
    with MetricLogger(tmp_path, total_steps=6, report_to="jsonl") as logger:
        for step in range(1, 6):
            logger.log(step, {"reward": step / 10})
        logger.log_samples(2, [{"prompt": "p2", "completion": "c", "reward": 1.0}])
        logger.log_samples(4, [{"prompt": "p4", "completion": "c", "reward": 0.0}])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rew')  # a crash cut the last line short
    # the checkpoint we resume from is step 3: steps 4..6 are redone
    with MetricLogger(tmp_path, total_steps=6, report_to="jsonl", start_step=3) as logger:
        for step in range(4, 7):
            logger.log(step, {"reward": step})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["reward"] for r in rows] == [0.1, 0.2, 0.3, 4, 5, 6]
    assert [r["prompt"] for r in read_jsonl(tmp_path / "samples.jsonl")] == ["p2"]


def test_truncate_jsonl_counts_and_leaves_good_file_alone(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    before = path.stat().st_mtime_ns
    assert truncate_jsonl(path, 3) == 0 and path.stat().st_mtime_ns == before
    assert truncate_jsonl(path, 1) == 2
    assert path.read_text() == '{"step": 1}\n'
    assert truncate_jsonl(tmp_path / "missing.jsonl", 0) == 0


def test_console_prints_compact_lines_every_n_steps(tmp_path):
    out = io.StringIO()
    keys = ("reward", "kl", "completions/mean_length")
    with MetricLogger(
        tmp_path,
        total_steps=4,
        report_to=["console"],
        print_every=2,
        progress_bar=False,
        console_keys=keys,
        stream=out,
    ) as logger:
        for step in range(1, 5):
            logger.log(step, {"reward": 0.123456, "kl": 1e-4, "completions/mean_length": 30.0, "other": 1.0})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 2/4 (50%) | reward 0.1235 | kl 0.0001 | len 30 | elapsed ")
    assert lines[1].startswith("step 4/4 (100%)")
    assert "other" not in out.getvalue()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_events_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="needs tensorboard: pip install tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricLogger(tmp_path, total_steps=2, report_to=["tensorboard"]) as logger:
        logger.log(1, {"reward": 0.5, "kl": None})
        logger.log(2, {"reward": 0.75})
        logger.log_samples(2, [{"prompt": "a|b", "completion": "c"}])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    assert "kl" not in acc.Tags()["scalars"]


def test_report_to_selection_and_errors(monkeypatch):
    assert resolve_report_to("none") == []
    assert resolve_report_to("console,jsonl") == ["console", "jsonl"]
    assert resolve_report_to(None)[:2] == ["console", "jsonl"]
    with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
        resolve_report_to(["tensorbord"])
    monkeypatch.setattr("cohort.run.logging._installed", lambda name: name != "wandb")
    with pytest.raises(ConfigError, match=r"`wandb` is not installed: pip install wandb"):
        resolve_report_to(["jsonl", "wandb"])
    assert "wandb" not in resolve_report_to("all")


def test_wandb_like_tracker_receives_scalars_and_table(tmp_path, monkeypatch):
    calls = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    fake = types.SimpleNamespace(
        init=lambda **kw: calls.append(("init", kw)),
        log=lambda data, step: calls.append(("log", data, step)),
        finish=lambda: calls.append(("finish",)),
        Table=Table,
    )
    monkeypatch.setitem(sys.modules, "trackio", fake)
    monkeypatch.setattr("cohort.run.logging._installed", lambda name: True)
    with MetricLogger(
        tmp_path, total_steps=2, report_to=["trackio"], run_name="r1", config={"lr": 1e-6}
    ) as lg:
        lg.log(1, {"reward": 1.0, "note": "text", "kl": float("inf")})
        lg.log_samples(1, [{"prompt": "p", "reward": 0.5}])
    assert calls[0] == ("init", {"project": "cohort", "name": "r1", "config": {"lr": 1e-6}})
    assert calls[1] == ("log", {"reward": 1.0}, 1)
    table = calls[2][1]["samples"]
    assert table.columns == ["prompt", "reward"] and table.data == [["p", 0.5]]
    assert calls[3] == ("finish",)

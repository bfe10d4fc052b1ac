"""plot_run: valid PNG files from metrics.jsonl, key selection, smoothing numbers, clear errors."""

import json

import pytest

from cohort.errors import ConfigError
from cohort.run.plot import load_series, plot_run, select_keys, smooth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir, steps=20):
    rows = []
    for step in range(1, steps + 1):
        rows.append(
            {
                "step": step,
                "time": 1.7e9 + step,
                "reward": step / steps,
                "reward_std": 0.3,
                "kl": None if step == 3 else 0.001 * step,
                "entropy": 2.0 - step / steps,
                "completions/mean_length": 50.0 + step,
                "rewards/accuracy/mean": step / (2 * steps),
                "clip_ratio/region_mean": 0.01,
                "step_time": 1.5,
                "learning_rate": 1e-6,
                "note": "text",
            }
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    return width, height


def test_plot_run_writes_a_valid_grid_png(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install matplotlib")
    write_metrics(tmp_path)
    paths = plot_run(tmp_path)
    assert paths == [tmp_path / "curves.png"]
    width, height = assert_png(paths[0])
    assert width > height > 0  # 3 columns x 3 rows of panels
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_per_key_files_and_explicit_keys(tmp_path):
    pytest.importorskip("matplotlib", reason="needs matplotlib: pip install matplotlib")
    write_metrics(tmp_path)
    paths = plot_run(
        tmp_path, keys=["reward", "rewards/*"], out=tmp_path / "plots" / "main.png", per_key=True
    )
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == [
        "plots/main.png",
        "plots/curves/reward.png",
        "plots/curves/rewards_accuracy_mean.png",
    ]
    for path in paths:
        assert_png(path)


def test_series_and_default_selection(tmp_path):
    write_metrics(tmp_path, steps=4)
    series = load_series(tmp_path)
    assert series["kl"] == ([1.0, 2.0, 4.0], [0.001, 0.002, 0.004])  # the null at step 3 is a gap
    assert "note" not in series and "time" not in series
    assert select_keys(list(series), None) == [
        "reward",
        "reward_std",
        "rewards/accuracy/mean",
        "kl",
        "entropy",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "step_time",
    ]
    assert select_keys(["a", "b"], None) == ["a", "b"]  # unknown names only: plot them all


def test_smoothing_is_a_debiased_ema():
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    # weight 0.5: avg = 0.5, 0.5*0.5+0.5*3 = 1.75; norm = 0.5, 0.75 -> [1.0, 1.75/0.75]
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 7 / 3])


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match=r"no metrics\.jsonl"):
        plot_run(tmp_path)
    write_metrics(tmp_path)
    with pytest.raises(ConfigError, match="did you mean 'reward'"):
        plot_run(tmp_path, keys=["rewad"])
    with pytest.raises(ConfigError, match=r"smoothing=1\.0"):
        plot_run(tmp_path, smoothing=1.0)

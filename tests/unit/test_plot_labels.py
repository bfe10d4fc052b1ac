"""The curves say what they show: step and unit on the axes, integer step ticks, a legend for raw vs
smoothed, and the smoothing window in the title (inspected on the matplotlib Figure itself)."""

from __future__ import annotations

import pytest

from cohort.run.plot import curves_figure, plot_run, y_label

pytest.importorskip("matplotlib", reason="plots need matplotlib: pip install matplotlib (or cohort-rl[logging])")

STEPS = [1.0, 2.0, 3.0, 4.0, 5.0]
SERIES = {
    "reward": (STEPS, [0.1, 0.3, 0.2, 0.5, 0.6]),
    "step_time": (STEPS, [1.5, 1.4, 1.6, 1.5, 1.5]),
    "completions/mean_length": (STEPS, [40.0, 38.0, 30.0, 25.0, 20.0]),
    "eval/accuracy": ([0.0, 5.0], [0.2, 0.4]),
}


def panels(fig):
    return {ax.get_title(): ax for ax in fig.axes}


def test_axes_have_step_and_units():
    fig = curves_figure(SERIES, list(SERIES), smoothing=0.6, title="run")
    axes = panels(fig)
    assert {k: ax.get_xlabel() for k, ax in axes.items()} == dict.fromkeys(SERIES, "step")
    assert {k: ax.get_ylabel() for k, ax in axes.items()} == {
        "reward": "reward", "step_time": "seconds", "completions/mean_length": "tokens",
        "eval/accuracy": "accuracy (fraction correct)"}


def test_legend_tells_raw_from_smoothed():
    axes = panels(curves_figure(SERIES, list(SERIES), smoothing=0.6))
    for key in ("reward", "step_time", "completions/mean_length"):
        legend = axes[key].get_legend()
        assert legend is not None, key
        assert [t.get_text() for t in legend.get_texts()] == ["raw", "smoothed (EMA 0.6)"], key
    assert [t.get_text() for t in axes["eval/accuracy"].get_legend().get_texts()] == ["held-out (exact)"]


@pytest.mark.parametrize(("weight", "window"), [(0.6, "smoothing window 4 steps"), (0.9, "smoothing window 19 steps")])
def test_title_names_the_smoothing_window(weight, window):
    fig = curves_figure(SERIES, ["reward"], smoothing=weight, title="chain_sum")
    title = fig.get_suptitle()
    assert title.startswith("chain_sum") and window in title and f"EMA weight {weight:g}" in title, title


def test_no_smoothing_is_said_and_draws_raw_only():
    fig = curves_figure(SERIES, ["reward"], smoothing=0.0)
    assert "no smoothing" in fig.get_suptitle()
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["raw"]


def test_step_ticks_are_integers():
    # 5 steps would get ticks at 1.0, 1.5, 2.0, ... without an integer locator
    fig = curves_figure(SERIES, list(SERIES), smoothing=0.6)
    fig.canvas.draw()  # the Agg canvas places the ticks
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)


def test_unknown_metric_is_labelled_by_its_name_and_plot_run_uses_the_figure(tmp_path):
    assert y_label("my/custom") == "my/custom"
    assert y_label("kl") == "nats" and y_label("clip_ratio/region_mean") == "fraction"
    assert y_label("time/generate") == "seconds" and y_label("rewards/accuracy/mean") == "reward"
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "reward": {s / 10}}}\n' for s in range(1, 6)))
    assert plot_run(tmp_path) == [tmp_path / "curves.png"]


def test_accuracy_interval_is_a_band_not_panels():
    series = {**SERIES, "eval/accuracy_ci_low": ([0.0, 5.0], [0.15, 0.33]),
              "eval/accuracy_ci_high": ([0.0, 5.0], [0.26, 0.47])}
    from cohort.run.plot import select_keys

    chosen = select_keys(list(series), None)
    assert "eval/accuracy" in chosen and not any("_ci_" in k for k in chosen)
    ax = panels(curves_figure(series, chosen, smoothing=0.6))["eval/accuracy"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["held-out (exact)", "95% interval (Wilson)"]
    (band,) = ax.collections  # fill_between's PolyCollection: its outline spans the logged bounds
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(0.15) and max(ys) == pytest.approx(0.47)

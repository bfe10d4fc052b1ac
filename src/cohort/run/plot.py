"""Training curves as PNG files from a run's `metrics.jsonl` (what `cohort plot RUN_DIR` calls).

    plot_run("runs/chain_sum")                 # -> [runs/chain_sum/curves.png]
    plot_run(run, keys=["reward", "kl"], per_key=True)

Each panel shows the raw values faintly and an exponential moving average on top (debiased as in
TensorBoard, so the first points are not pulled towards zero), with a legend telling them apart, the step
on the x axis (integer ticks) and the metric's unit on the y axis; the figure's title gives the smoothing
window. Matplotlib is used through a bare `Figure` with the Agg canvas, so plotting never changes the
backend of a notebook or script that imports cohort.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

from cohort.errors import ConfigError
from cohort.run.directory import METRICS_FILE
from cohort.run.logging import read_jsonl

CURVES_FILE = "curves.png"
# The default panels, in order; globs pick up per-function rewards, eval metrics and clipping statistics.
DEFAULT_PATTERNS = (
    "reward",
    "reward_std",
    "eval*accuracy*",
    "eval*pass@*",
    "eval*reward",
    "rewards/*/mean",
    "kl",
    "entropy",
    "completions/mean_length",
    "tools/call_frequency",
    "tools/failure_frequency",
    "tools/turns_per_completion",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "frac_reward_zero_std",
    "step_time",
)
Series = tuple[list[float], list[float]]
# A metric `X` with `X_ci_low` and `X_ci_high` beside it (the evaluation's 95% Wilson interval for accuracy) is
# drawn with its interval as a shaded band; the bounds get no panels of their own.
CI_SUFFIXES = ("_ci_low", "_ci_high")
# The y axis's label (a unit where the metric has one), by the first matching glob; else the metric's name.
Y_LABELS = (
    (("reward", "reward_std*", "rewards/*", "eval*reward*"), "reward"),
    (("eval*accuracy*", "eval*pass@*"), "accuracy (fraction correct)"),
    (("clip_ratio/*", "frac_*", "*clipped_ratio", "*clip_ratio", "tools/*_frequency"), "fraction"),
    (("step_time", "time/*", "*_time", "*_s", "*seconds*"), "seconds"),
    (("completions/*length*", "*tokens*"), "tokens"),
    (("kl", "entropy"), "nats"),
    (("tools/turns_per_completion",), "turns"),
    (("learning_rate",), "learning rate"),
    (("grad_norm",), "gradient norm"),
)


def load_series(run_dir: str | os.PathLike) -> dict[str, Series]:
    """Every numeric metric of a run as (steps, values), in first-seen order; nulls are skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise ConfigError(
            f"no {METRICS_FILE} in {str(run_dir)!r}: pass a cohort run directory (the output_dir of "
            "`cohort train`, which writes metrics from its first step)"
        )
    series: dict[str, Series] = {}
    for row in read_jsonl(path):
        step = row.get("step")
        if not isinstance(step, int | float):
            continue
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            steps, values = series.setdefault(key, ([], []))
            steps.append(float(step))
            values.append(float(value))
    return series


def select_keys(available: Sequence[str], keys: Sequence[str] | None) -> list[str]:
    """The panels to draw: the defaults that exist, or the user's keys (globs allowed), checked."""
    if keys is None:
        chosen = [k for pattern in DEFAULT_PATTERNS for k in available if fnmatch.fnmatchcase(k, pattern)]
        chosen = [k for k in dict.fromkeys(chosen) if not _is_band_of(k, available)]
        if not chosen:  # a run logging only custom names still gets a plot
            chosen = list(available)[:12]
        return chosen
    chosen = []
    for pattern in keys:
        matches = [k for k in available if fnmatch.fnmatchcase(k, pattern)]
        if not matches:
            close = difflib.get_close_matches(pattern, available, n=3)
            hint = f"did you mean {', '.join(map(repr, close))}? " if close else ""
            raise ConfigError(
                f"plot key {pattern!r} is not in the run's metrics: {hint}available: {', '.join(available)}"
            )
        chosen.extend(matches)
    return list(dict.fromkeys(chosen))


def _is_band_of(key: str, available: Sequence[str]) -> bool:
    """True for `X_ci_low` / `X_ci_high` when `X` exists: drawn as X's band, not as a panel."""
    return any(key.endswith(sfx) and key[: -len(sfx)] in available for sfx in CI_SUFFIXES)


def band(series: dict[str, Series], key: str) -> tuple[list[float], list[float], list[float]] | None:
    """(steps, low, high) of `key`'s confidence interval, at the steps where both bounds were logged."""
    low, high = (series.get(key + sfx) for sfx in CI_SUFFIXES)
    if low is None or high is None:
        return None
    highs = dict(zip(*high))
    steps = [s for s in low[0] if s in highs]
    lows = dict(zip(*low))
    return steps, [lows[s] for s in steps], [highs[s] for s in steps]


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average; weight 0 returns the values unchanged."""
    out, avg, norm = [], 0.0, 0.0
    for value in values:
        avg = weight * avg + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(avg / norm if norm else value)
    return out


def y_label(key: str) -> str:
    """The y axis's label of a metric: its unit (reward, seconds, tokens, fraction, nats, ...) or its name."""
    for patterns, label in Y_LABELS:
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            return label
    return key


def smoothing_note(weight: float) -> str:
    """The smoothing in words for a title: the EMA weight and its window, span = (1 + w) / (1 - w) steps
    (the span of pandas' ewm, alpha = 2 / (span + 1) = 1 - w)."""
    if weight == 0:
        return "raw values, no smoothing"
    return f"smoothing window {(1 + weight) / (1 - weight):.3g} steps (EMA weight {weight:g})"


def _draw(ax, key: str, steps: list[float], values: list[float], weight: float,
          interval: tuple[list[float], list[float], list[float]] | None = None) -> None:
    from matplotlib.ticker import MaxNLocator  # optional dependency (the logging extra: curves)

    if key.startswith("eval"):
        # held-out evaluations are few points, each exact: a moving average would draw values never measured
        (line,) = ax.plot(steps, values, "o-", linewidth=1.8, label="held-out (exact)")
        if interval is not None and interval[0]:
            ax.fill_between(interval[0], interval[1], interval[2], color=line.get_color(), alpha=0.2,
                            label="95% interval (Wilson)")
    else:
        _draw_smoothed(ax, steps, values, weight)
    ax.set_title(key, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(y_label(key), fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")


def _draw_smoothed(ax, steps: list[float], values: list[float], weight: float) -> None:
    smoothed = len(values) > 1 and weight > 0
    (raw,) = ax.plot(steps, values, alpha=0.3 if smoothed else 1.0, linewidth=1, label="raw")
    if smoothed:
        ax.plot(steps, smooth(values, weight), color=raw.get_color(), linewidth=1.8,
                label=f"smoothed (EMA {weight:g})")
    elif len(values) == 1:
        ax.plot(steps, values, "o", color=raw.get_color())


def curves_figure(series: dict[str, Series], keys: Sequence[str], *, smoothing: float = 0.6,
                  title: str = "", ncols: int = 3):
    """A matplotlib `Figure` with one panel per key (grid of `ncols` columns), titled with the smoothing."""
    from matplotlib.figure import Figure  # optional dependency (the logging extra: curves)

    ncols = min(ncols, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.1 * nrows) if len(keys) > 1 else (6, 4), layout="constrained")
    for i, key in enumerate(keys):
        _draw(fig.add_subplot(nrows, ncols, i + 1), key, *series[key], smoothing, band(series, key))
    note = smoothing_note(smoothing)
    fig.suptitle(f"{title} ({note})" if title else note, fontsize=12 if len(keys) > 1 else 10)
    return fig


def _save(fig, path: Path) -> Path:
    # Write beside the target and rename, so a viewer never reads a half-written PNG.
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    return path


def _safe_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", key).strip("_") or "metric"


def plot_run(
    run_dir: str | os.PathLike,
    *,
    keys: Sequence[str] | None = None,
    out: str | os.PathLike | None = None,
    per_key: bool = False,
    smoothing: float = 0.6,
    title: str | None = None,
) -> list[Path]:
    """Write `curves.png` (a grid of panels) and, with `per_key`, one PNG per metric; return the paths.

    `out` is a directory (default: the run directory) or a `.png` path for the grid; per-key files go to
    a `curves/` folder beside the grid.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ConfigError(
            f"smoothing={smoothing!r}: use a weight in [0, 1), e.g. 0.6 (0 draws raw values only)"
        )
    series = load_series(run_dir)
    if not series:
        raise ConfigError(f"{METRICS_FILE} in {str(run_dir)!r} holds no numeric metrics yet: nothing to plot")
    chosen = select_keys(list(series), keys)
    out = Path(out) if out is not None else Path(run_dir)
    grid_path = out if out.suffix.lower() == ".png" else out / CURVES_FILE
    grid_path.parent.mkdir(parents=True, exist_ok=True)

    fig = curves_figure(series, chosen, smoothing=smoothing, title=title or Path(run_dir).resolve().name)
    written = [_save(fig, grid_path)]

    if per_key:
        folder = grid_path.parent / "curves"
        folder.mkdir(exist_ok=True)
        for key in chosen:
            single = curves_figure(series, [key], smoothing=smoothing)
            written.append(_save(single, folder / f"{_safe_name(key)}.png"))
    return written

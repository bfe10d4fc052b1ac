"""Training curves as PNG files from a run's `metrics.jsonl` (what `cohort plot RUN_DIR` calls).

    plot_run("runs/chain_sum")                 # -> [runs/chain_sum/curves.png]
    plot_run(run, keys=["reward", "kl"], per_key=True)

Each panel shows the raw values faintly and an exponential moving average on top (debiased as in
TensorBoard, so the first points are not pulled towards zero). Matplotlib is used through a bare `Figure`
with the Agg canvas, so plotting never changes the backend of a notebook or script that imports cohort.
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
        chosen = list(dict.fromkeys(chosen))
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


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Debiased exponential moving average; weight 0 returns the values unchanged."""
    out, avg, norm = [], 0.0, 0.0
    for value in values:
        avg = weight * avg + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(avg / norm if norm else value)
    return out


def _draw(ax, key: str, steps: list[float], values: list[float], weight: float) -> None:
    if key.startswith("eval"):
        # held-out evaluations are few points, each exact: a moving average would draw values never measured
        ax.plot(steps, values, "o-", linewidth=1.8)
    else:
        _draw_smoothed(ax, steps, values, weight)
    ax.set_title(key, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def _draw_smoothed(ax, steps: list[float], values: list[float], weight: float) -> None:
    (raw,) = ax.plot(steps, values, alpha=0.3, linewidth=1)
    if len(values) > 1:
        ax.plot(steps, smooth(values, weight), color=raw.get_color(), linewidth=1.8)
    else:
        ax.plot(steps, values, "o", color=raw.get_color())


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
    from matplotlib.figure import Figure  # optional dependency (the logging extra: curves)

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

    ncols = min(3, len(chosen))
    nrows = math.ceil(len(chosen) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.1 * nrows), layout="constrained")
    for i, key in enumerate(chosen):
        _draw(fig.add_subplot(nrows, ncols, i + 1), key, *series[key], smoothing)
    fig.suptitle(title or Path(run_dir).resolve().name, fontsize=12)
    written = [_save(fig, grid_path)]

    if per_key:
        folder = grid_path.parent / "curves"
        folder.mkdir(exist_ok=True)
        for key in chosen:
            single = Figure(figsize=(6, 4), layout="constrained")
            _draw(single.add_subplot(1, 1, 1), key, *series[key], smoothing)
            written.append(_save(single, folder / f"{_safe_name(key)}.png"))
    return written

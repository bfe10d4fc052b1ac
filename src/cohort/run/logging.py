"""Metric sinks: a console progress bar, `metrics.jsonl`, TensorBoard, and W&B / trackio when asked for.

The trainer chooses the metric names (TRL's: reward, reward_std, kl, entropy, completions/mean_length,
clip_ratio/region_mean, step_time, ...); this module only writes them:

    logger = MetricLogger(run_dir, total_steps=100, start_step=resumed_step)
    logger.log(step, {"reward": 0.5, "kl": 0.001, ...})
    logger.log_samples(step, [{"prompt": ..., "completion": ..., "reward": 1.0}])
    logger.close()

Files in the run directory: `metrics.jsonl` (one JSON object per step: step, wall time, every metric) and
`samples.jsonl` (one object per sample row). On resume (`start_step > 0`) rows after the resumed step are
dropped before appending, so the file never holds a step twice. Non-finite numbers are written as null so
the files stay strict JSON that any tool reads.

This module is `cohort.run.logging`; with absolute imports (the only kind Python 3 has) it never shadows the
standard library's `logging`, which cohort's other modules keep importing as `import logging`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import math
import numbers
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from cohort.errors import ConfigError
from cohort.run.directory import METRICS_FILE, atomic_write_text

SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
SINKS = ("console", "jsonl", "tensorboard", "wandb", "trackio")
DEFAULT_CONSOLE_KEYS = (
    "reward",
    "reward_std",
    "kl",
    "entropy",
    "completions/mean_length",
    "frac_reward_zero_std",
    "step_time",
)
# Short names keep the progress-bar postfix on one line.
_SHORT_NAMES = {
    "completions/mean_length": "len",
    "frac_reward_zero_std": "zero_std",
    "clip_ratio/region_mean": "clip",
}


# ------------------------------------------------------------------------------------------ JSONL files
def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a line cut short by a crash (always the last one) is skipped."""
    rows: list[dict[str, Any]] = []
    path = Path(path)
    if not path.is_file():
        return rows
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> int:
    """Keep only rows with `step <= max_step` (atomically); return how many rows were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    rows = read_jsonl(path)
    kept = [r for r in rows if isinstance(r.get("step"), int | float) and r["step"] <= max_step]
    with path.open("rb") as f:
        torn = not f.read().endswith(b"\n") and path.stat().st_size > 0
    if len(kept) != len(rows) or torn:
        atomic_write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    return len(rows) - len(kept)


def _clean(value: Any) -> Any:
    """A JSON-ready copy: tensors and NumPy scalars become numbers, NaN and inf become None."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    elif hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return str(value)


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics a dashboard can plot: finite numbers only."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


# ---------------------------------------------------------------------------------------------- sinks
class _JsonlSink:
    def __init__(self, run_dir: Path, start_step: int) -> None:
        self.metrics_path, self.samples_path = run_dir / METRICS_FILE, run_dir / SAMPLES_FILE
        for path in (self.metrics_path, self.samples_path):
            truncate_jsonl(path, start_step)
        self._metrics = self.metrics_path.open("a", encoding="utf-8")
        self._samples: Any = None  # opened on the first sample rows

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, "time": round(time.time(), 3), **metrics}
        self._metrics.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics.flush()  # a crash loses at most the line being written

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if self._samples is None:
            self._samples = self.samples_path.open("a", encoding="utf-8")
        for row in rows:
            self._samples.write(json.dumps({"step": step, **row}, allow_nan=False, ensure_ascii=False) + "\n")
        self._samples.flush()

    def close(self) -> None:
        for f in (self._metrics, self._samples):
            if f is not None:
                f.close()


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class _TensorBoardSink:
    def __init__(self, run_dir: Path, start_step: int) -> None:
        # optional dependency (the logging extra: TensorBoard)
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events a crashed run wrote after the checkpoint we resume from.
        purge = start_step + 1 if start_step > 0 else None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge, flush_secs=30)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("samples", _markdown_table(rows), step)

    def close(self) -> None:
        self.writer.close()


class _TrackerSink:
    """W&B and trackio share one API shape: init(project, name, config), log(dict, step), finish()."""

    def __init__(
        self,
        module_name: str,
        run_dir: Path,
        run_name: str | None,
        project: str | None,
        config: Mapping[str, Any] | None,
    ) -> None:
        self.module = importlib.import_module(module_name)
        kwargs: dict[str, Any] = {
            "project": project or "cohort",
            "name": run_name,
            "config": dict(config or {}),
        }
        if module_name == "wandb":
            kwargs["dir"] = str(run_dir)
        self.run = self.module.init(**kwargs)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.module.log(_scalars(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table_cls = getattr(self.module, "Table", None)
        if table_cls is None or not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[row.get(c) for c in columns] for row in rows]
        self.module.log({"samples": table_cls(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.module.finish()


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _format_duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class _ConsoleSink:
    def __init__(
        self,
        total_steps: int,
        start_step: int,
        console_keys: Sequence[str],
        print_every: int,
        progress_bar: bool | None,
        stream: Any,
    ) -> None:
        self.total, self.start_step, self.keys = total_steps, start_step, tuple(console_keys)
        self.print_every, self.stream = print_every, stream
        self.started = time.monotonic()
        # progress_bar=None: tqdm shows the bar on a terminal and stays silent when output goes to a file,
        # where the periodic lines below are the progress record.
        disable = None if progress_bar is None else not progress_bar
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=disable,
            file=sys.stderr,
            desc="train",
        )
        self.tqdm = tqdm

    def _pairs(self, metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
        return [(_SHORT_NAMES.get(k, k), _format_value(metrics[k])) for k in self.keys if k in metrics]

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pairs = self._pairs(metrics)
        self.bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in pairs), refresh=False)
        self.bar.update(max(0, step - self.bar.n))
        if step % self.print_every == 0 or step >= self.total:
            self.tqdm.write(self.line(step, pairs), file=self.stream)

    def line(self, step: int, pairs: list[tuple[str, str]]) -> str:
        elapsed = time.monotonic() - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        metrics = " | ".join(f"{k} {v}" for k, v in pairs)
        pct = 100.0 * step / self.total if self.total else 100.0
        timing = f"elapsed {_format_duration(elapsed)}"
        if math.isfinite(eta):
            timing += f" eta {_format_duration(eta)}"
        return (
            f"step {step}/{self.total} ({pct:.0f}%) | {metrics} | {timing}"
            if metrics
            else f"step {step}/{self.total} ({pct:.0f}%) | {timing}"
        )

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # samples are for files and dashboards; the console keeps one line per step

    def close(self) -> None:
        self.bar.close()


# -------------------------------------------------------------------------------------------- selection
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_report_to(report_to: str | Iterable[str] | None) -> list[str]:
    """Sink names from a user setting: None (console, jsonl, tensorboard if installed), "all", "none", a
    comma-separated string or a list. Unknown names and requested-but-missing packages raise ConfigError."""
    if report_to is None:
        return ["console", "jsonl"] + (["tensorboard"] if _installed("tensorboard") else [])
    names = (
        [s.strip() for s in report_to.split(",")]
        if isinstance(report_to, str)
        else [str(s) for s in report_to]
    )
    names = [n for n in names if n]
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return ["console", "jsonl"] + [n for n in ("tensorboard", "wandb", "trackio") if _installed(n)]
    for name in names:
        if name not in SINKS:
            close = difflib.get_close_matches(name, SINKS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(
                f"report_to has unknown sink {name!r}: {hint}choose from {', '.join(SINKS)}, 'all' or 'none'"
            )
        if name in ("tensorboard", "wandb", "trackio") and not _installed(name):
            raise ConfigError(
                f"report_to includes {name!r} but the package `{name}` is not installed: pip install {name}, "
                f"or remove {name!r} from report_to"
            )
    return list(dict.fromkeys(names))


# ------------------------------------------------------------------------------------------- the logger
class MetricLogger:
    """Sends each step's metrics (and optional sample rows) to every selected sink."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        total_steps: int,
        report_to: str | Iterable[str] | None = None,
        run_name: str | None = None,
        start_step: int = 0,
        console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
        print_every: int | None = None,
        progress_bar: bool | None = None,
        project: str | None = None,
        config: Mapping[str, Any] | None = None,
        stream: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.sink_names = resolve_report_to(report_to)
        run_name = run_name or self.run_dir.name
        every = print_every or max(1, total_steps // 20)
        self.sinks: list[Any] = []
        try:
            for name in self.sink_names:
                if name == "console":
                    self.sinks.append(
                        _ConsoleSink(
                            total_steps, start_step, console_keys, every, progress_bar, stream or sys.stdout
                        )
                    )
                elif name == "jsonl":
                    self.sinks.append(_JsonlSink(self.run_dir, start_step))
                elif name == "tensorboard":
                    self.sinks.append(_TensorBoardSink(self.run_dir, start_step))
                else:
                    self.sinks.append(_TrackerSink(name, self.run_dir, run_name, project, config))
        except BaseException:
            self.close()
            raise
        self.last_step = start_step
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record the metrics of `step` (numbers, 0-d tensors or NumPy scalars) in every sink."""
        clean = {str(k): _clean(v) for k, v in metrics.items()}
        for sink in self.sinks:
            sink.log(step, clean)
        self.last_step = step

    def log_samples(self, step: int, rows: list[Mapping[str, Any]]) -> None:
        """Record sample rows (prompt, completion, rewards, ...) to samples.jsonl and dashboards."""
        clean = [{str(k): _clean(v) for k, v in row.items()} for row in rows]
        for sink in self.sinks:
            sink.log_samples(step, clean)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

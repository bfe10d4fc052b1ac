"""What an interrupted run (Ctrl-C) tells its user: the newest checkpoint and how to continue from it, or that
there is none and how to start again. The command line (`cohort train`) and the TRL facade (`trainer.train()`)
say the same thing, each with its own way to continue."""

from __future__ import annotations

from pathlib import Path

from cohort.run.directory import run_has_progress
from cohort.run.layout import latest_checkpoint


def interrupted_message(output_dir: str | Path, *, resume: str, restart: str, restart_over_progress: str) -> str:
    """resume: what continues from the newest checkpoint; restart: what starts again in an empty run directory;
    restart_over_progress: what starts again over a directory that holds metrics but no checkpoint."""
    out = Path(output_dir).expanduser()
    latest = latest_checkpoint(out) if out.is_dir() else None
    if latest is not None:
        return f"cohort: interrupted. The newest checkpoint is {latest}; continue from it with:\n  {resume}"
    if out.is_dir() and run_has_progress(out):
        return (f"cohort: interrupted before the first checkpoint; {out} holds metrics but nothing to resume from. "
                f"Start again with:\n  {restart_over_progress}")
    return f"cohort: interrupted before the first checkpoint (nothing was kept). Start again with:\n  {restart}"

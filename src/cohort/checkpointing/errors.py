"""The checkpoint error type (defined in `cohort.errors`, so that `cohort.run.state` can raise it too), and the
message for a file that cannot be read."""

from __future__ import annotations

from pathlib import Path

from cohort.errors import CheckpointError

__all__ = ["CheckpointError", "damaged"]


def damaged(file: Path, e: BaseException) -> CheckpointError:
    """The error for a checkpoint file that exists but cannot be read (truncated, garbage, unsafe)."""
    return CheckpointError(
        f"checkpoint file {str(file)!r} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        "): it is truncated or damaged (a copy cut short, a full disk). Resume from an earlier checkpoint "
        "(run.resume=<path to checkpoints/step-NNNNNN>) or delete this checkpoint folder"
    )

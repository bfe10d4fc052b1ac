"""Asynchronous rollouts on the colocated engine (`train.async_rollouts`): groups streamed into steps as they
finish, sequences that continue across weight updates, staleness bounded by `train.max_staleness`.

    pacing.py    which groups a step may admit and must train on, so no token is more than k versions stale
    rollouts.py  StreamingRollouts: the trainer's rollout source (`get(step)`), over cohort.engine.streaming
    versions.py  staleness/mean and staleness/max over a step's sampled tokens

docs/training.md ("Asynchronous rollouts") says what is stale and how the loss corrects it.
"""

from __future__ import annotations

from cohort.engine import CohortEngine
from cohort.streaming.pacing import Pacer
from cohort.streaming.rollouts import Finished, StreamingRollouts
from cohort.streaming.versions import token_staleness

__all__ = ["Finished", "Pacer", "StreamingRollouts", "resident_engine", "token_staleness"]


def resident_engine(engine: object) -> CohortEngine | None:
    """The cohort engine that samples for `engine` (itself, or the one a wrapper refreshes weights for: FSDP's
    gathered mirror, a 4-bit policy's merged copy), or None (Hugging Face generate, a server, the VLM engine):
    only cohort's engine keeps sequences resident between calls."""
    for _ in range(4):  # wrappers nest at most a couple deep
        if isinstance(engine, CohortEngine):
            return engine
        engine = getattr(engine, "engine", None)
    return None

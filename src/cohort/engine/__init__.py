"""cohort's rollout engines.

`CohortEngine` (engine.py) is the in-process paged engine; `engine_supports(model)` says whether it can run a
given policy (else the trainer falls back to the reference Hugging Face backend, hf_backend.py).
"""

from cohort.engine.config import EngineConfig
from cohort.engine.engine import CohortEngine, EngineStats
from cohort.engine.models.registry import engine_supports

__all__ = ["CohortEngine", "EngineConfig", "EngineStats", "engine_supports"]

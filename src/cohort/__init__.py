"""cohort: GRPO and its 2025 variants, with a rollout engine that reads the trainer's weights in place.

    from cohort import GRPOConfig, GRPOTrainer      # TRL's API, cohort's loop
    from cohort import CohortConfig, load_config, train
"""

from cohort.config import CohortConfig, load_config
from cohort.trainer import train as _train
from cohort.trl_compat import GRPOConfig, GRPOTrainer

__version__ = "0.1.0"


def train(config: CohortConfig):
    """Run `cohort train` from Python; returns the TrainResult (run directory, history, held-out evals)."""
    return _train(config)


__all__ = ["CohortConfig", "GRPOConfig", "GRPOTrainer", "load_config", "train"]

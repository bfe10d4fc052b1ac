"""cohort: GRPO and its 2025 variants, with a rollout engine that reads the trainer's weights in place."""

__version__ = "0.1.0"

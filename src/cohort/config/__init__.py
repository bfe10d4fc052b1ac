"""Every setting of a cohort run, with its default, in one place.

A run is configured by `CohortConfig`, a tree of dataclasses. Field names follow TRL's `GRPOConfig` where
the concept is the same (num_generations, max_completion_length, temperature, beta, epsilon, loss_type,
scale_rewards, num_iterations, ...), grouped into sections so a YAML recipe reads top to bottom:

    model:      what to train            generation: how completions are sampled
    data:       where prompts come from  reward:     how completions are scored
    loss:       the policy loss variant  advantage:  how rewards become advantages
    train:      batch schedule, optimiser, precision
    run:        output directory, logging, checkpoints, evaluation
    agent:      tools the model may call (multi-turn tool-calling rollouts)

Batch semantics, stated once: each step takes `train.prompts_per_step` prompts and samples
`generation.num_generations` completions for each. The step's completions are split into
`train.mini_batches` optimiser updates (verl's ppo_mini_batch), and the whole set is passed over
`train.num_iterations` times (TRL's num_iterations, PPO epochs). `train.token_budget` only caps the tokens of
one forward/backward (micro-batch): it changes speed and memory, never the maths.

Recipes are YAML files with the same tree; `apply_overrides` takes `section.field=value` strings from the
command line. Unknown keys fail with a "did you mean" suggestion.

This package is the public API; its modules, one role each:

    sections.py    the section dataclasses (ModelConfig ... AgentConfig): every field, default and help, in order
    tree.py        CohortConfig, the root with one field per section; to_dict, validate (once per unchanged config)
    validation.py  the order of the checks: batch schedule and cross-section rules, then fields, then inputs
    checks.py      every field's range and enum (validate_fields) and the shared `_require` helpers
    async_checks.py  train.async_rollouts against the settings streamed rollouts cannot run with yet
    overrides.py   setting fields by dotted key: apply_overrides, config_from_dict (and `_set`, used by TRL's facade)
    recipes.py     YAML recipes in and out: load_config, dump_config
    help.py        every field's key, type, default and help text: `cohort train --help-config`, docs/settings.md
"""

from cohort.config.agent_section import AgentConfig
from cohort.config.overrides import apply_overrides, config_from_dict
from cohort.config.recipes import dump_config, load_config
from cohort.config.sections import (
    AdvantageConfig,
    DataConfig,
    GenerationConfig,
    LossConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    TrainConfig,
)
from cohort.config.tree import CohortConfig
from cohort.errors import ConfigError  # re-exported: what load_config / validate raise

__all__ = [
    "AdvantageConfig",
    "AgentConfig",
    "CohortConfig",
    "ConfigError",
    "DataConfig",
    "GenerationConfig",
    "LossConfig",
    "ModelConfig",
    "RewardConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "config_from_dict",
    "dump_config",
    "load_config",
]

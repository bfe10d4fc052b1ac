"""`CohortConfig`: the root of the config tree, one field per section (cohort.config.sections).

The section order here is the order of a recipe, a saved `config.yaml` and `--print-config`. Checking a config
lives in cohort.config.validation; reading one from YAML and overrides in cohort.config.recipes / overrides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cohort.config.sections import (
    AdvantageConfig,
    AgentConfig,
    DataConfig,
    GenerationConfig,
    LossConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    TrainConfig,
)
from cohort.config.validation import validate_config


@dataclass
class CohortConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data; a callable (a reward function handed in from Python) becomes its import path."""
        return _plain(dataclasses.asdict(self))

    @property
    def completions_per_step(self) -> int:
        return self.train.prompts_per_step * self.generation.num_generations

    def validate(self) -> CohortConfig:
        """Check cross-field rules before any work; each error names the field, the value and the fix."""
        validate_config(self)
        return self


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', type(value).__name__)}"
    return value

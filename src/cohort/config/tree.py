"""`CohortConfig`: the root of the config tree, one field per section (cohort.config.sections).

The section order here is the order of a recipe, a saved `config.yaml` and `--print-config`. Checking a config
lives in cohort.config.validation; reading one from YAML and overrides in cohort.config.recipes / overrides.

Validation runs once per config, not once per caller: `load_config`, `build_components` and `train` each call
`validate()`, and a second call on the same, unchanged config returns at once. After a successful check the
config keeps a fingerprint of every field's value; any change (an override, a facade setting, a mutated list
or mapping, another object in a field) changes the fingerprint, and the next `validate()` checks it all again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from cohort.config.agent_section import AgentConfig
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
        """Check cross-field rules before any work; each error names the field, the value and the fix.
        A config validated before and unchanged since is not checked again (see the module docstring)."""
        digest, objects = _fingerprint(self)
        if getattr(self, _VALIDATED, (None,))[0] == digest:
            return self
        validate_config(self)
        # the objects keep their ids (part of the digest) from being reused while the config remembers them
        setattr(self, _VALIDATED, (digest, objects))
        return self


def section_types() -> dict[str, type]:
    """Section name -> its dataclass, in config order: the field list that overrides, "did you mean" and
    `cohort train --help-config` (cohort.config.help) share."""
    defaults = CohortConfig()  # every field is a section dataclass with a default factory
    return {f.name: type(getattr(defaults, f.name)) for f in dataclasses.fields(CohortConfig)}


# the attribute (not a dataclass field: to_dict, asdict and config.yaml never see it) holding the fingerprint
_VALIDATED = "_validated_fingerprint"
_PLAIN = (str, int, float, bool, type(None))


def _fingerprint(cfg: CohortConfig) -> tuple[str, list[Any]]:
    """(a digest of every field's value, the non-plain objects in them). Plain values enter by type and repr
    (1, 1.0 and True differ); any other object (a reward function, a dataset) by its type and identity."""
    objects: list[Any] = []
    text = _describe(cfg, objects)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest(), objects


def _describe(value: Any, objects: list[Any]) -> str:
    if type(value) in _PLAIN:
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(f"{f.name}={_describe(getattr(value, f.name), objects)}" for f in dataclasses.fields(value))
        return f"{type(value).__name__}({inner})"
    if type(value) is dict:
        return "{" + ", ".join(f"{_describe(k, objects)}: {_describe(v, objects)}" for k, v in value.items()) + "}"
    if type(value) in (list, tuple):
        inner = ", ".join(_describe(v, objects) for v in value)
        return f"[{inner}]" if type(value) is list else f"({inner})"
    objects.append(value)
    return f"<{type(value).__module__}.{type(value).__qualname__} at {id(value):#x}>"


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', type(value).__name__)}"
    return value

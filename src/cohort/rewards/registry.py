"""Find a reward function by builtin name, import path or reward-model folder: `get_reward_function`."""

from __future__ import annotations

import difflib
import functools
import inspect
from pathlib import Path
from typing import Any

from cohort.data.sources import import_object
from cohort.errors import ConfigError
from cohort.rewards import builtins
from cohort.rewards.reasoning_gym import reasoning_gym_score
from cohort.rewards.reward_model import RewardModel

# Plain functions: keyword arguments are bound with functools.partial.
FUNCTIONS = {
    "accuracy": builtins.accuracy,
    "think_format": builtins.think_format,
    "think_answer_format": builtins.think_answer_format,
    "answer_format": builtins.answer_format,
    "answer_number": builtins.answer_number,
    "number_line_format": builtins.number_line_format,
    "reasoning_gym": reasoning_gym_score,
}
# Factories: called with the keyword arguments, they return the reward function.
FACTORIES = {
    "soft_overlong_punishment": builtins.soft_overlong_punishment,
    "cosine_scaled_length": builtins.cosine_scaled_length,
    "reward_model": RewardModel,
}
# TRL's names, so a recipe written for TRL reads the same.
ALIASES = {
    "accuracy_reward": "accuracy",
    "think_format_reward": "think_format",
    "get_soft_overlong_punishment": "soft_overlong_punishment",
    "get_cosine_scaled_reward": "cosine_scaled_length",
}


def builtin_names() -> list[str]:
    return sorted([*FUNCTIONS, *FACTORIES])


def get_reward_function(name_or_path: str, **kwargs: Any) -> Any:
    """A reward function from a builtin name, `"pkg.mod:fn"`, or a reward-model folder.

    kwargs configure it: a factory (soft_overlong_punishment, cosine_scaled_length, a class, or an import
    path whose target takes no `completions` argument) is called with them; a reward function gets them
    bound (functools.partial, keeping its name for metrics).
    """
    name = ALIASES.get(name_or_path, name_or_path)
    if name in FUNCTIONS:
        return _bind(FUNCTIONS[name], name, kwargs)
    if name in FACTORIES:
        return _make(FACTORIES[name], name, kwargs)
    if Path(name).is_dir():
        return RewardModel(name, **kwargs)
    if ":" in name:
        target = import_object(name)
        if not kwargs:
            return target
        return _bind(target, name, kwargs) if _is_reward_signature(target) else _make(target, name, kwargs)
    close = difflib.get_close_matches(name, builtin_names() + list(ALIASES), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        f"Unknown reward function {name_or_path!r}.{hint} Use a builtin ({', '.join(builtin_names())}), an "
        "import path 'package.module:function', or a folder holding a sequence-classification reward model."
    )


def _is_reward_signature(fn: Any) -> bool:
    if inspect.isclass(fn):
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name in ("completions", "completion_ids", "prompts") for p in params)


def _bind(fn: Any, name: str, kwargs: dict[str, Any]) -> Any:
    if not kwargs:
        return fn
    bound = functools.partial(fn, **kwargs)
    bound.__name__ = getattr(fn, "__name__", name)  # type: ignore[attr-defined]
    return bound


def _make(factory: Any, name: str, kwargs: dict[str, Any]) -> Any:
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ConfigError(
            f"Reward function {name!r} could not be built with {kwargs}: {e}. "
            f"Its settings are: {inspect.signature(factory)}."
        ) from e

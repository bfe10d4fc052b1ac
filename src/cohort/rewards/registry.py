"""Find a reward function by builtin name, import path or reward-model folder: `get_reward_function`; and the
answer a builtin reads from a completion (`answer_extractor`, for the evaluation's majority vote)."""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cohort.data.sources import import_object
from cohort.errors import ConfigError
from cohort.rewards import builtins
from cohort.rewards.judge import JudgeReward
from cohort.rewards.reasoning_gym import extract_answer, reasoning_gym_score
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
    "judge": JudgeReward,
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


# -- answers, for majority votes --------------------------------------------------------------------
AnswerExtractor = Callable[[str, dict[str, Any]], "str | None"]
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _tag_or_boxed(text: str, row: dict[str, Any]) -> str | None:
    """accuracy's answer: the last `<answer>` tag, else the last `\\boxed{}`, whitespace collapsed."""
    for pattern in (builtins.ANSWER_TAG, _BOXED):
        found = pattern.findall(text)
        if found:
            return " ".join(found[-1].split())
    return None


def _number(text: str, row: dict[str, Any]) -> str | None:
    """answer_number's answer: the committed number, written without a trailing `.0`."""
    value = builtins.extract_numeric_answer(text)
    if value is None:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def _reasoning_gym(mode: str) -> AnswerExtractor:
    def extract(text: str, row: dict[str, Any]) -> str | None:
        return extract_answer(text, str(row.get("answer", "")), mode)  # type: ignore[arg-type]
    return extract


def answer_extractor(fn: Any) -> AnswerExtractor | None:
    """How reward function `fn` reads the answer out of a completion's text, as ``(text, row) -> str | None``
    (row: the sample's dataset columns), or None when it has no such rule.

    Builtins: accuracy (the last `<answer>` tag, else `\\boxed{}`), answer_number (the committed number),
    reasoning_gym (its own extraction, with the bound `extract` mode). Any other function may carry an
    ``extract_answer(text) -> str | None`` attribute.
    """
    target = getattr(fn, "func", fn)  # functools.partial: the function under the bound settings
    bound = getattr(fn, "keywords", None) or {}
    if target is builtins.accuracy:
        return _tag_or_boxed
    if target is builtins.answer_number:
        return _number
    if target is reasoning_gym_score:
        return _reasoning_gym(str(bound.get("extract", "auto")))
    own = getattr(fn, "extract_answer", None) or getattr(target, "extract_answer", None)
    if callable(own):
        return lambda text, row: own(text)
    return None

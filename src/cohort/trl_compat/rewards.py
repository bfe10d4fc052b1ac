"""TRL's reward_funcs: callables, or reward models given as a model object, a local folder, or a hub id.

A reward model scores prompt + completion with the first logit of a sequence-classification model (TRL's
rule, `cohort.rewards.RewardModel`), on the training device.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import AutoTokenizer

from cohort.errors import ConfigError
from cohort.rewards import registry
from cohort.rewards.protocol import accepted_kwargs, reward_name
from cohort.rewards.reward_model import RewardModel
from cohort.setup.policy import resolve_device

log = logging.getLogger("cohort.trl_compat")


class TrlRewardRunner:
    """The run's reward runner with TRL's handling of rows no function scored: where every function returned
    None for a completion, TRL logs a warning naming that row's arguments and trains on (those rows count 0,
    as TRL's nansum gives); cohort's own runner refuses a training batch in which no completion was scored at
    all. Everything else is the wrapped `RewardRunner`'s."""

    def __init__(self, runner: Any):
        self.runner = runner

    def __getattr__(self, name: str) -> Any:  # funcs, weights, names, timeout_s, ... of the wrapped runner
        return getattr(self.runner, name)

    def with_functions(self, extra: list) -> TrlRewardRunner:
        return TrlRewardRunner(self.runner.with_functions(extra))

    def __call__(self, prompts, completions, completion_ids, columns=None, trainer_state=None):
        state = trainer_state
        if dataclasses.is_dataclass(state) and hasattr(state, "is_eval"):  # warn, not raise, on all-None batches
            state = dataclasses.replace(state, is_eval=True)
        with warnings.catch_warnings():  # the TRL warning below replaces cohort's
            warnings.simplefilter("ignore")
            result = self.runner(prompts, completions, completion_ids, columns, state)
        rows = result.all_none_rows
        if rows:
            i = rows[0]
            shown = {k: v[i] for k, v in (columns or {}).items() if k not in ("trainer_state", "log_extra", "log_metric")}
            shown.update(prompt=prompts[i], completion=completions[i])
            log.warning("All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at "
                        "least one reward function returns a valid reward.", shown)
        return result


class SharedRewardModel(RewardModel):
    """A reward model the facade loaded: shared, never copied (the config's to_dict deep-copies reward functions,
    which would copy the model and its tokenizer at every config dump)."""

    def __deepcopy__(self, memo) -> SharedRewardModel:
        return self


def resolve_reward_funcs(funcs: list[Any], processing_classes: Any, cfg, state: Any = None) -> list[Any]:
    """Reward models become `RewardModel`s on the training device; a function that takes `trainer_state`
    receives `state` (transformers' TrainerState: global_step = optimiser steps done, as in TRL)."""
    device = resolve_device(cfg.train.device)
    if processing_classes is not None and not isinstance(processing_classes, list | tuple):
        processing_classes = [processing_classes]
    out = []
    for i, func in enumerate(funcs):
        tok = processing_classes[i] if processing_classes is not None and i < len(processing_classes) else None
        if isinstance(func, str | os.PathLike):
            out.append(_with_tokenizer(_from_name(str(func), device), tok))
        elif _is_model(func):
            out.append(_from_model(func, tok, device))
        else:
            out.append(_with_state(func, state) if state is not None else func)
    return out


def _with_state(func: Any, state: Any) -> Any:
    """`func` with its trainer_state argument replaced by `state`; name, signature, partial-bound keywords and
    async-ness kept (the reward runner reads all four)."""
    accepted, _ = accepted_kwargs(func)
    if accepted is not None and "trainer_state" not in accepted:
        return func
    target = func if inspect.isfunction(func) or inspect.ismethod(func) else getattr(func, "__call__", func)  # noqa: B004

    def swap(kwargs):
        if "trainer_state" in kwargs:
            kwargs["trainer_state"] = state
        return kwargs

    wrapper: Any  # a function that carries attributes too: __signature__, keywords
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(target):
        async def call_async(*args, **kwargs):
            return await func(*args, **swap(kwargs))
        wrapper = call_async
    else:
        def call(*args, **kwargs):
            return func(*args, **swap(kwargs))
        wrapper = call
    functools.update_wrapper(wrapper, func, updated=())
    wrapper.__signature__ = inspect.signature(func)  # what inspect.signature(wrapper) reports
    if getattr(func, "keywords", None):  # functools.partial: its bound settings stay bound
        wrapper.keywords = func.keywords
    wrapper.__name__ = reward_name(func)
    return wrapper


def _with_tokenizer(reward: Any, tokenizer: Any) -> Any:
    """A reward model loaded by name scores with the processing class given for it (TRL's pairing), if any."""
    if tokenizer is not None and isinstance(reward, RewardModel):
        reward.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if reward.model.config.pad_token_id is None:
            reward.model.config.pad_token_id = tokenizer.pad_token_id
    return reward


def _is_model(obj: Any) -> bool:
    return isinstance(obj, torch.nn.Module) and hasattr(obj, "config")


def _from_name(name: str, device) -> RewardModel:
    if Path(name).is_dir():
        return SharedRewardModel(name, device=device)
    if ":" in name or name in _registered():  # cohort's own names ("accuracy", "pkg.mod:fn") stay names
        return name  # type: ignore[return-value]
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(name, local_files_only=offline)
    except LocalEntryNotFoundError as exc:
        raise ConfigError(f"reward_funcs={name!r}: the hub id is not in the local cache and HF_HUB_OFFLINE is set "
                          "(or the hub cannot be reached); download it where there is network, or pass a local "
                          "folder saved with save_pretrained (reward_funcs='path/to/reward_model').") from exc
    except Exception as exc:  # (network, auth, a missing repo)
        raise ConfigError(f"reward_funcs={name!r} could not be loaded from the hub ({type(exc).__name__}: {exc}); "
                          "with no network set HF_HUB_OFFLINE=1 and pass a local folder saved with "
                          "save_pretrained instead.") from exc
    rm = SharedRewardModel(path, device=device)
    # named after the hub id, as TRL names it, not after the snapshot folder it was read from
    rm.name = rm.__name__ = name.rstrip("/").split("/")[-1]
    rm.model.config._name_or_path = name  # what from_pretrained(name) would have recorded
    return rm


def _registered() -> set[str]:
    return {*registry.FUNCTIONS, *registry.FACTORIES, *registry.ALIASES}


def _from_model(model, tokenizer, device) -> RewardModel:
    if tokenizer is None:
        name = getattr(model.config, "_name_or_path", "")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as exc:
            raise ConfigError("reward_funcs=<a model object> needs its tokenizer: pass "
                              "reward_processing_classes=[tokenizer] (one per reward function).") from exc
    rm = SharedRewardModel.__new__(SharedRewardModel)
    rm.model = model.eval().to(device)
    rm.tokenizer = tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    rm.batch_size, rm.max_length = 16, None
    name = str(getattr(model.config, "_name_or_path", "") or "").rstrip("/").split("/")[-1]
    rm.name = rm.__name__ = name or "reward_model"
    return rm

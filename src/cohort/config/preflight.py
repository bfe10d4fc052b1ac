"""Checks of a run's inputs that need more than the config's own fields, made before any work (issue 14).

`check_inputs(cfg)` (called by `CohortConfig.validate`) checks what the config *names*: the options of a data
source against what that source's loader accepts (a reasoning-gym task's config dataclass, a callable's
signature, the prompt options of `load_prompt_dataset`), reward function names and their keyword arguments,
tool import paths, and what model.quantization needs of the machine (CUDA, bitsandbytes). `check_paths(cfg)` (called by the CLI before the model loads) checks the file system:
the model path, the run directory (`--resume` / `--overwrite` rules) and a resume checkpoint path.

Every failure is a `ConfigError` naming the field, the value and the fix, with "did you mean" for near misses.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from cohort.data.sources import REASONING_GYM_PREFIX, import_object, load_prompt_dataset
from cohort.errors import ConfigError
from cohort.policy import model as model_mod
from cohort.policy import quantized
from cohort.rewards import registry
from cohort.run.directory import _RUN_MARKERS, is_run_dir

# keyword options of load_prompt_dataset that a data source's `options` may set for any source
PROMPT_OPTIONS = ("columns", "instruction", "conversational", "limit", "seed")
# load_prompt_dataset arguments the config sets from its own fields: in `options` they would collide
_DATA_FIELDS = {"split": "data.split", "prompt_column": "data.prompt_column", "system_prompt": "data.system_prompt",
                "few_shot": "data.few_shot", "source": "data.source"}
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_ANY = None  # a loader that takes any keyword (datasets.load_dataset's config kwargs, a callable's **kwargs)


def _hint(key: str, options: Iterable[str]) -> str:
    options = sorted(set(options))
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"it takes: {', '.join(options)}" if options else "it takes no options"


# ------------------------------------------------------------------------------------------- data options
def _looks_local(source: str) -> bool:
    return source.startswith((".", "/", "~")) or source.lower().endswith(_FILE_SUFFIXES) or "\\" in source


def _reasoning_gym_task(task: str, field: str, source: str) -> tuple[type, type]:
    try:
        # optional dependency (the data extra: reasoning-gym tasks)
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise ConfigError(f"{field}={source!r} needs reasoning-gym: pip install reasoning-gym "
                          "(or cohort-rl[data]).") from exc
    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=1, cutoff=0.6)
        hint = f"did you mean 'reasoning_gym:{close[0]}'?" if close else \
            "see reasoning_gym.factory.DATASETS for the task names (e.g. chain_sum, basic_arithmetic)"
        raise ConfigError(f"{field}={source!r} is not valid: reasoning-gym has no task {task!r}; {hint}")
    return DATASETS[task]


def _callable_keys(fn: Any) -> list[str] | None:
    """The keyword names `fn` takes; None when it takes any (a **kwargs parameter or no readable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return _ANY
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _ANY
    return [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)]


def source_option_keys(source: Any, field: str = "data.source") -> tuple[list[str] | None, Any]:
    """(the option names `source`'s loader accepts or None for any, the reasoning-gym config class or None)."""
    if not isinstance(source, str):
        if callable(source):
            keys = _callable_keys(source)
            return (None if keys is None else [*PROMPT_OPTIONS, *keys]), None
        return list(PROMPT_OPTIONS), None  # rows, a Dataset, a PromptDataset: only the prompt options
    if source.startswith(REASONING_GYM_PREFIX):
        _, config_cls = _reasoning_gym_task(source[len(REASONING_GYM_PREFIX):], field, source)
        names = [f.name for f in dataclasses.fields(config_cls)] if dataclasses.is_dataclass(config_cls) else None
        return (None if names is None else [*PROMPT_OPTIONS, "size", *names]), config_cls
    path = Path(source).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix.lower() not in _FILE_SUFFIXES:
                raise ConfigError(f"{field}={source!r} is not valid: cohort reads {', '.join(_FILE_SUFFIXES)} files; "
                                  "convert it, or give a folder, a datasets name or 'reasoning_gym:<task>'")
            return list(PROMPT_OPTIONS), None
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            return list(PROMPT_OPTIONS), None  # datasets.load_from_disk takes no options
        return _ANY, None  # a folder of data files: datasets.load_dataset and its config kwargs
    if _looks_local(source):
        return _ANY, None  # a file still to come (recipes name data the user brings); check_paths says so
    if ":" in source and not source.startswith(("hf:", "http")):
        try:
            fn = import_object(source)
        except ConfigError as exc:
            raise ConfigError(f"{field}={source!r} is not valid: {exc}") from None
        keys = _callable_keys(fn)
        return (None if keys is None else [*PROMPT_OPTIONS, *keys]), None
    return _ANY, None  # a datasets name: load_dataset passes unknown keywords to the builder's config


def check_source_options(source: Any, options: Mapping[str, Any], field: str, options_field: str) -> None:
    """Every key of `options` must be one the source's loader takes; reasoning-gym settings are also
    validated by the task's own config class."""
    if not isinstance(options, Mapping):
        return  # CohortConfig.validate names the type error
    for key in options:
        if key in _DATA_FIELDS:
            raise ConfigError(f"{options_field}.{key}={options[key]!r} is not valid: set {_DATA_FIELDS[key]} "
                              f"instead (it is a field of its own)")
    keys, config_cls = source_option_keys(source, field)
    if keys is not None:
        for key, value in options.items():
            if key not in keys:
                src = source if isinstance(source, str) else getattr(source, "__name__", type(source).__name__)
                raise ConfigError(f"{options_field}.{key}={value!r} is not an option of {field}={src!r}: "
                                  f"{_hint(key, keys)} (remove it or fix the name)")
    if config_cls is not None:  # reasoning-gym: build the task's config now, so a bad value fails before any work
        settings = {k: v for k, v in options.items() if k not in PROMPT_OPTIONS or k == "seed"}
        settings.setdefault("size", 500)
        try:
            config = config_cls(**settings)
            if hasattr(config, "validate"):
                config.validate()
        except Exception as exc:  # reasoning-gym uses asserts, ValueError, TypeError
            raise ConfigError(f"{options_field}={dict(options)!r} is not valid for {field}={source!r}: "
                              f"{type(exc).__name__}: {exc or 'a setting is out of range'}; fix that setting "
                              f"(the task's settings: {', '.join(sorted(set(keys or [])))})") from None


# ------------------------------------------------------------------------------------------------ rewards
def _reward_kwarg_keys(target: Any, is_factory: bool) -> list[str] | None:
    """Keyword arguments a reward spec may carry: a factory's parameters, or a reward function's named
    parameters (its **kwargs receives dataset columns, so an unknown name there would be silently ignored)."""
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return _ANY
    named = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                   inspect.Parameter.KEYWORD_ONLY)]
    if is_factory and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _ANY
    return [n for n in named if n not in ("self", "completions", "prompts", "completion_ids")]


def _resolve_reward(field: str, name: str) -> tuple[Any, bool]:
    """(the function or factory a reward name means, whether it is a factory), without calling it."""
    resolved = registry.ALIASES.get(name, name)
    if resolved in registry.FUNCTIONS:
        return registry.FUNCTIONS[resolved], False
    if resolved in registry.FACTORIES:
        return registry.FACTORIES[resolved], True
    if Path(resolved).expanduser().is_dir():
        return registry.RewardModel, True
    if ":" in resolved:
        target = _import_callable(field, name, resolved, "not a function; point it at a reward function or a factory")
        return target, not registry._is_reward_signature(target)
    known = registry.builtin_names() + list(registry.ALIASES)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"use a builtin ({', '.join(registry.builtin_names())})"
    raise ConfigError(f"{field}={name!r} is not a known reward function: {hint} Or give "
                      "'package.module:function' or a reward-model folder.")


def check_reward_specs(funcs: list[Any]) -> None:
    for i, spec in enumerate(funcs):
        field = f"reward.funcs[{i}]"
        if callable(spec) and not isinstance(spec, str):
            continue
        kwargs: Any = {}
        if isinstance(spec, Mapping):
            if len(spec) != 1:
                raise ConfigError(f"{field}={dict(spec)!r} is not valid: write a name or a one-key mapping "
                                  "{name: {kwargs}}, e.g. {soft_overlong_punishment: {max_completion_len: 256}}")
            (name, kwargs), = spec.items()
            kwargs = kwargs or {}
            if not isinstance(kwargs, Mapping):
                raise ConfigError(f"{field}={dict(spec)!r} is not valid: the settings of {name!r} must be a mapping "
                                  "of keyword: value")
        elif isinstance(spec, str):
            name = spec
        else:
            raise ConfigError(f"{field}={spec!r} is not valid: give a reward name, 'package.module:function', "
                              "or {name: {kwargs}}")
        if not isinstance(name, str):
            continue
        target, factory = _resolve_reward(field, name)
        if kwargs:
            keys = _reward_kwarg_keys(target, factory)
            if keys is not None:
                for key, value in kwargs.items():
                    if key not in keys:
                        raise ConfigError(f"{field}.{name}.{key}={value!r} is not a setting of reward {name!r}: "
                                          f"{_hint(key, keys)}")


# -------------------------------------------------------------------------------------------------- tools
def _import_callable(field: str, value: Any, path: str, fix: str) -> Any:
    """The callable `path` ('package.module:name') names; a ConfigError naming the field otherwise."""
    try:
        target = import_object(path)
    except ConfigError as exc:
        raise ConfigError(f"{field}={value!r} is not valid: {exc}") from None
    if not callable(target):
        raise ConfigError(f"{field}={value!r} is not valid: it names a {type(target).__name__}, {fix}")
    return target


def check_tools(tools: list[Any], tool_parser: str | None) -> None:
    for i, tool in enumerate(tools or []):
        if isinstance(tool, str):
            _import_callable(f"agent.tools[{i}]", tool, tool, "point it at a function with type hints and a docstring")
        elif not callable(tool):
            raise ConfigError(f"agent.tools[{i}]={tool!r} is not valid: give a function or 'package.module:function'")
    if tool_parser:
        try:
            import_object(tool_parser)
        except ConfigError as exc:
            raise ConfigError(f"agent.tool_parser={tool_parser!r} is not valid: {exc}") from None


def check_inputs(cfg: Any) -> None:
    """What `CohortConfig.validate` checks beyond single fields: the machine model.quantization needs, data
    options, reward specs, tool paths."""
    check_quantization_support(cfg)
    d = cfg.data
    check_source_options(d.source, d.options, "data.source", "data.options")
    if d.eval_options and not d.eval_source:
        raise ConfigError(f"data.eval_options={d.eval_options!r} is not valid without data.eval_source: set "
                          "data.eval_source too, or put task settings in data.options (the held-out split of "
                          "data.source uses those)")
    if d.eval_source:
        check_source_options(d.eval_source, d.eval_options, "data.eval_source", "data.eval_options")
    check_reward_specs(list(cfg.reward.funcs))
    check_tools(list(cfg.agent.tools), cfg.agent.tool_parser)


def check_quantization_support(cfg: Any) -> None:
    """model.quantization (QLoRA) on this machine: a CUDA GPU, bitsandbytes and peft, before any model loads."""
    q = cfg.model.quantization
    why = None if q == "none" else quantized.missing_support(cfg.train.device)
    if why is not None:
        raise ConfigError(f"model.quantization={q!r} is not valid here: {why}.")


# ------------------------------------------------------------------------------------ the file system (CLI)
def check_model_path(name_or_path: str, gguf_file: str | None = None) -> None:
    """The model path's mistakes that need no loading: a missing local path, a folder that is no model, a
    COHORT_CACHE_DIR (where GGUF models are converted) that is a file."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if os.environ.get("COHORT_CACHE_DIR"):
        model_mod.default_cache_dir()
    if name.lower() in model_mod.SMOLLM2_NAMES and not path.exists():
        if name.lower() == model_mod.SMOLLM2_NAMES[0]:
            model_mod.smollm2_gguf_path()  # names the missing package
        return
    if gguf_file is not None:
        gguf = Path(gguf_file).expanduser()
        gguf = gguf if gguf.is_absolute() or not path.is_dir() else path / gguf
        if not gguf.is_file():
            raise ConfigError(f"model.gguf_file={gguf_file!r} does not exist (looked for {str(gguf)!r}); give the "
                              "path to a .gguf file")
        return
    if path.suffix == ".gguf" and not path.is_file():
        raise ConfigError(f"model.name_or_path={name!r} does not exist; give the path to a .gguf file")
    if path.is_dir() and not (path / "config.json").is_file() and len(list(path.glob("*.gguf"))) != 1:
        raise ConfigError(f"model.name_or_path={name!r} is a folder without config.json (or with several .gguf "
                          "files); point it at a Hugging Face model folder (config.json + weights) or a .gguf file")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"model.name_or_path={name!r} is a file, not a model folder; give the folder that "
                          "holds config.json, or a .gguf file")
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if looks_local and not path.exists():
        raise ConfigError(f"model.name_or_path={name!r} does not exist; check the path (or give a hub id such "
                          "as HuggingFaceTB/SmolLM2-135M-Instruct)")


def check_run_dir(cfg: Any) -> None:
    """`run.output_dir`, `run.resume` and `run.overwrite` against what is on disk, without changing it."""
    run = cfg.run
    path = Path(run.output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run.output_dir={run.output_dir!r} is a file, not a directory: choose another "
                          "run.output_dir")
    _check_writable(run.output_dir, path)
    nonempty = path.is_dir() and next(path.iterdir(), None) is not None
    resume = run.resume not in (False, None, "")
    if nonempty and not resume and not run.overwrite:
        raise ConfigError(f"run.output_dir={run.output_dir!r} already exists and is not empty: pass --resume to "
                          "continue that run, --overwrite to delete it and start again, or choose another "
                          "run.output_dir")
    if nonempty and run.overwrite and not resume and not is_run_dir(path):
        raise ConfigError(f"run.overwrite=True refuses to delete run.output_dir={run.output_dir!r}: it is not "
                          f"empty and does not look like a cohort run (none of {', '.join(_RUN_MARKERS)} in "
                          "it); choose another run.output_dir")
    if isinstance(run.resume, str) and run.resume:
        ckpt = Path(run.resume).expanduser()
        if not ckpt.is_dir():
            raise ConfigError(f"run.resume={run.resume!r} does not exist; give a checkpoint folder "
                              f"(e.g. {os.path.join(run.output_dir, 'checkpoints', 'step-000010')}) or true for "
                              "the newest one")


def _check_writable(value: str, path: Path) -> None:
    """The run directory, or the nearest folder above it that exists, must let this user create files."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != path.absolute() and not existing.is_dir():
        raise ConfigError(f"run.output_dir={value!r} cannot be created: {str(existing)!r} is a file, not a folder; "
                          "choose another run.output_dir")
    if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run.output_dir={value!r} cannot be written: this user may not create files in "
                          f"{str(existing)!r}; choose another run.output_dir (or fix the folder's permissions)")


def check_data_paths(cfg: Any) -> None:
    """A data source that names a local file or folder must exist (checked when a run starts, not by
    `validate`: a recipe may name data the user brings)."""
    for field in ("source", "eval_source"):
        source = getattr(cfg.data, field)
        if isinstance(source, str) and _looks_local(source) and not Path(source).expanduser().exists():
            raise ConfigError(f"data.{field}={source!r} does not exist: check the path (a .jsonl/.json/.parquet/"
                              ".csv file or a folder), or give a datasets name or 'reasoning_gym:<task>'")


def check_local_data(cfg: Any) -> None:
    """Local data files are read once now (cheap next to a model load): a broken line, an empty file or a
    missing prompt column fails before the model loads."""
    d = cfg.data
    for source, options, split in ((d.source, d.options, d.split), (d.eval_source, d.eval_options, "train")):
        if isinstance(source, str) and Path(source).expanduser().is_file():
            load_prompt_dataset(source, split=split, prompt_column=d.prompt_column, system_prompt=d.system_prompt,
                                few_shot=d.few_shot, **options)


def check_recipe_run(cfg: Any) -> None:
    """Rules for a run whose data comes from the config (the CLI), not handed in from Python (the facade)."""
    d, run = cfg.data, cfg.run
    if run.eval_steps and not (d.eval_source or d.eval_size):
        raise ConfigError(f"run.eval_steps={run.eval_steps!r} is not valid: there is no held-out set to evaluate "
                          "on; set data.eval_size (e.g. 100) or data.eval_source, or run.eval_steps=0")


def check_paths(cfg: Any) -> None:
    check_recipe_run(cfg)
    check_model_path(cfg.model.name_or_path, cfg.model.gguf_file)
    check_data_paths(cfg)
    check_local_data(cfg)
    check_run_dir(cfg)

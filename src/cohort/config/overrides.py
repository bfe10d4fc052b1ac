"""Setting config fields by dotted key: `section.field=value` overrides and the flattened tree of a recipe.

A key names a section and one of its fields (`train.max_steps`); a bare field name is accepted when only one
section has it; deeper keys go into a mapping field (`data.options.min_terms`); keys of `loss` that are not
its fields are that loss's own parameters (`loss.params`). Values are coerced to the field's annotated type,
and an unknown key fails with a "did you mean" that also gives the suggested field's help text. The keys come
from the section dataclasses' fields (`cohort.config.tree.section_types`), as `cohort train --help-config` does.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import yaml

from cohort.config.sections import help_of
from cohort.config.tree import CohortConfig, section_types
from cohort.errors import ConfigError


def _did_you_mean(key: str, options: list[str], section: str | None = None) -> str:
    """" Did you mean 'x'?" and x's help text, for the closest option (field names of `section`, or dotted
    keys when section is None); the known keys when none is close."""
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    if not close:
        return f" Known keys: {', '.join(sorted(options))}."
    dotted = close[0] if section is None else f"{section}.{close[0]}"
    return f" Did you mean '{close[0]}'? {_help_line(dotted)}"


def _help_line(dotted: str) -> str:
    """'section.field: its help text.' from the field's metadata (the text `--help-config` prints)."""
    section, name = dotted.split(".", 1)
    field = next(f for f in dataclasses.fields(section_types()[section]) if f.name == name)
    return f"{dotted}: {help_of(field).rstrip('.')}."


def _all_dotted_keys() -> list[str]:
    keys = []
    for name, cls in section_types().items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


def _set(cfg: CohortConfig, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = section_types()
    if parts[0] not in sections:
        # a bare field name (e.g. "num_generations") is accepted when it is unique across sections
        owners = [s for s, cls in sections.items() if parts[0] in {f.name for f in dataclasses.fields(cls)}]
        if len(parts) == 1 and len(owners) == 1:
            parts = [owners[0], parts[0]]
        else:
            raise ConfigError(f"Unknown config key '{dotted}'.{_did_you_mean(dotted, _all_dotted_keys())}")
    if len(parts) < 2:
        raise ConfigError(f"Config key '{dotted}' names a section; set one of its fields, e.g. "
                          f"{parts[0]}.{dataclasses.fields(sections[parts[0]])[0].name}=...")
    section = getattr(cfg, parts[0])
    names = [f.name for f in dataclasses.fields(section)]
    if parts[0] == "loss" and parts[1] not in names and len(parts) == 2:
        section.params[parts[1]] = value  # a loss-specific parameter, checked by the loss itself
        return
    if parts[1] not in names:
        raise ConfigError(f"Unknown config key '{dotted}'.{_did_you_mean(parts[1], names, parts[0])} "
                          f"(fields of '{parts[0]}': {', '.join(names)})")
    if len(parts) > 2:  # into a dict-valued field, e.g. data.options.min_terms=2 or loss.params.tau_pos=1
        target = getattr(section, parts[1])
        if not isinstance(target, dict):
            raise ConfigError(f"Config key '{dotted}': '{parts[0]}.{parts[1]}' is not a mapping.")
        for p in parts[2:-1]:
            target = target.setdefault(p, {})
        target[parts[-1]] = value
        return
    annotation = str(next(f.type for f in dataclasses.fields(section) if f.name == parts[1]))
    setattr(section, parts[1], _coerce(dotted, annotation, value))


def _coerce(dotted: str, annotation: str, value: Any) -> Any:
    """Match YAML's guess to the field's type: YAML 1.1 reads `2e-6` as a string, `1` as an int."""
    if value is None or not isinstance(value, str | int | float) or isinstance(value, bool):
        if annotation.startswith("list") and isinstance(value, str):
            return [value]
        return value
    kind = annotation.split("|")[0].strip()
    try:
        if kind == "float":
            return float(value)
        if kind == "int" and (isinstance(value, str) or float(value).is_integer()):
            return int(float(value)) if isinstance(value, float) else int(value)
    except ValueError:
        raise ConfigError(f"{dotted}={value!r} is not a valid {kind}; give a number, e.g. {dotted}=1") from None
    if annotation.startswith("list") and isinstance(value, str):
        return [value]
    return value


def _flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and prefix == "":
            out += _flatten(value, dotted + ".")
        else:
            out.append((dotted, value))
    return out


def config_from_dict(tree: dict[str, Any] | None, base: CohortConfig | None = None) -> CohortConfig:
    cfg = base or CohortConfig()
    for dotted, value in _flatten(tree or {}):
        _set(cfg, dotted, value)
    return cfg


def apply_overrides(cfg: CohortConfig, overrides: list[str]) -> CohortConfig:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} must look like section.field=value, e.g. loss.epsilon=0.3.")
        key, raw = item.split("=", 1)
        _set(cfg, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return cfg

"""YAML recipes in and out: `load_config` reads a recipe, applies overrides and validates; `dump_config`
writes the resolved config (the run directory's `config.yaml`, `--print-config`) in field order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cohort.config.overrides import apply_overrides, config_from_dict
from cohort.config.tree import CohortConfig
from cohort.errors import ConfigError


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> CohortConfig:
    """Read a YAML recipe (or the defaults when path is None), apply `key=value` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe={str(path)!r} does not exist; give the path to a YAML recipe "
                              "(see recipes/ in the repository).")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"recipe={str(path)!r} is not valid YAML{where}: {what}; fix that line (each "
                              "section is a mapping, e.g. 'train:' then '  max_steps: 3').") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe={str(path)!r} must be a mapping of sections, got {type(tree).__name__}.")
    cfg = config_from_dict(tree)
    apply_overrides(cfg, overrides or [])
    return cfg.validate()


def dump_config(cfg: CohortConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

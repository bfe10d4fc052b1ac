"""YAML recipes in and out: `load_config` reads a recipe, applies overrides and validates; `dump_config`
writes the resolved config (the run directory's `config.yaml`, `--print-config`) in field order.

A recipe is read defensively: at most 1 MiB of UTF-8 text, and a document whose aliases would expand to more
than 100,000 nodes ("billion laughs"), that refers to itself, or that nests deeper than Python can follow is
refused with one line, before its values reach any message. Override values (`key=<YAML>`) get the same checks.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from cohort.config.overrides import apply_overrides, config_from_dict
from cohort.config.tree import CohortConfig
from cohort.errors import ConfigError

MAX_RECIPE_BYTES = 1 << 20  # 1 MiB: far above any real recipe, far below what could hurt
MAX_RECIPE_NODES = 100_000  # scalars, lists and mappings after aliases are expanded


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> CohortConfig:
    """Read a YAML recipe (or the defaults when path is None), apply `key=value` overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe={str(path)!r} does not exist; give the path to a YAML recipe "
                              "(see recipes/ in the repository).")
        try:
            tree = _load_yaml(_recipe_text(p, str(path)), f"recipe={str(path)!r}") or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"recipe={str(path)!r} is not valid YAML{where}: {what}; fix that line (each "
                              "section is a mapping, e.g. 'train:' then '  max_steps: 3').") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"recipe={str(path)!r} must be a mapping of sections, got {type(tree).__name__}.")
    _check_override_values(overrides or [])
    cfg = config_from_dict(tree)
    apply_overrides(cfg, overrides or [])
    return cfg.validate()


def _recipe_text(p: Path, path: str) -> str:
    size = p.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise ConfigError(f"recipe={path!r} is {size:,} bytes, over the 1 MiB a recipe may have; is it the right "
                          "file? (a recipe is a short YAML file of sections)")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"recipe={path!r} is not a UTF-8 text file (byte 0x{data[exc.start]:02x} at line {line}); "
                          "give a YAML recipe, saved as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"recipe={path!r} is a binary file (it holds NUL bytes), not a YAML recipe; check the path")
    return text


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader; `_load_yaml` measures the composed document before constructing it."""


def _load_yaml(text: str, what: str) -> Any:
    """yaml.safe_load, refusing documents whose aliases expand past MAX_RECIPE_NODES or refer to themselves;
    `what` starts each error (recipe='r.yaml', the override 'train.max_steps')."""
    loader = _RecipeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(f"{what} nests too deeply to read (hundreds of levels); write it flat") from None
        if node is None:
            return None
        _check_expansion(node, what)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_override_values(overrides: list[str]) -> None:
    """An override's value is YAML too: an alias bomb or a value nested too deeply is refused before it reaches
    any message (apply_overrides reports every other mistake, unreadable YAML included)."""
    for item in overrides:
        key, _, raw = item.partition("=")
        with contextlib.suppress(yaml.YAMLError):  # not YAML: apply_overrides says so
            _load_yaml(raw, f"the override {key.strip()!r}")


def _check_expansion(root: yaml.Node, what: str) -> None:
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(f"{what} has an alias that refers to itself; remove the recursive alias")
        open_nodes.add(key)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_RECIPE_NODES:
                raise ConfigError(f"{what} expands to more than {MAX_RECIPE_NODES:,} values through its aliases "
                                  "(*name); a value this large is a mistake or an alias bomb: write the values "
                                  "out, or use fewer nested aliases")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    try:
        size(root)
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to read (hundreds of levels); write it flat") from None


def dump_config(cfg: CohortConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

"""Every setting's key, type, default and help text, read from the section dataclasses (cohort.config.sections)
and their fields' metadata alone: `cohort train --help-config [section]` prints them, and docs/settings.md is
this module's markdown, written by

    python -m cohort.config.help --write docs/settings.md

(tests/unit/test_config_help.py fails when the checked-in file differs from `render_markdown()`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from cohort.config.sections import help_of
from cohort.config.tree import section_types
from cohort.errors import ConfigError

REGENERATE = "python -m cohort.config.help --write docs/settings.md"
# the widest a text column is aligned to (longer cells overflow it)
_COLUMN_CAPS = (("key", 44), ("type", 24), ("default", 24))


class FieldRow(NamedTuple):
    """One setting: `section.name`, its annotation, its default as a recipe writes it, its help text."""

    section: str
    name: str
    type: str
    default: str
    help: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def section_names() -> list[str]:
    return list(section_types())


def check_section(name: str) -> str:
    """`name` when it is a section; a ConfigError naming the value, the choices and the closest one otherwise."""
    names = section_names()
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ConfigError(f"--help-config {name!r} is not a config section: {hint}choose one of {', '.join(names)} "
                      "(or none, for every section)")


def yaml_value(value: Any) -> str:
    """A value as a recipe or a `section.field=value` override writes it: null, true, 1.0e-06, [a, b], {}."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def field_rows(section: str | None = None) -> list[FieldRow]:
    """Every field of every section (or of the one named), in config order."""
    chosen = section_types() if section is None else {check_section(section): section_types()[section]}
    return [FieldRow(name, f.name, str(f.type), yaml_value(_default(f)), help_of(f))
            for name, cls in chosen.items() for f in dataclasses.fields(cls)]


def section_doc(section: str) -> str:
    """The section class's own docstring, one paragraph per line ("" when it has none: dataclass writes one)."""
    cls = section_types()[section]
    doc = inspect.cleandoc(cls.__doc__ or "")
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclass puts there when the class has no docstring
        return ""
    return "\n".join(" ".join(p.split()) for p in doc.split("\n\n"))


def render_text(section: str | None = None) -> str:
    """`section.name  type  default  help`, one row per field, columns aligned, a header per section."""
    width = max(shutil.get_terminal_size((110, 24)).columns, 80)
    out: list[str] = []
    for name in [check_section(section)] if section is not None else section_names():
        out += [f"[{name}]", *textwrap.wrap(section_doc(name), width, initial_indent="  ", subsequent_indent="  ",
                                            break_on_hyphens=False)]
        out += _text_rows(field_rows(name), width)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _text_rows(rows: list[FieldRow], width: int) -> list[str]:
    """The rows of one section: key, type and default in aligned columns, the help wrapped beside them; a cell
    wider than its column's cap (a long default list) pushes that row's help to the next lines."""
    widths = [min(max(len(getattr(r, col)) for r in rows), cap) for col, cap in _COLUMN_CAPS]
    indent = sum(widths) + 2 * len(widths)
    out: list[str] = []
    for r in rows:
        head = "  ".join(v.ljust(w) for v, w in zip((r.key, r.type, r.default), widths, strict=True)) + "  "
        lines = textwrap.wrap(r.help, max(width - indent, 40), break_on_hyphens=False) or [""]
        if len(head) > indent:
            out.append(head.rstrip())
            head = " " * indent
        out += [head + lines[0], *(" " * indent + line for line in lines[1:])]
    return out


def _cell(text: str, code: bool = False) -> str:
    """A table cell: `|` escaped (GitHub reads it inside code too); in prose also `*` and `<` (emphasis, HTML)."""
    text = text.replace("|", "\\|")
    if code:
        return f"`{text}`" if text else text
    return text.replace("*", "\\*").replace("<", "\\<")


def render_markdown() -> str:
    """docs/settings.md: one table per section (field, type, default, help)."""
    out = ["# Settings", "",
           "Every setting of a `cohort train` run: set it in a recipe (`section:` then `  field: value`) or on the "
           "command line as `section.field=value`; `cohort train --help-config [section]` prints the same list.",
           "",
           f"Generated from the fields of `src/cohort/config/sections.py` by `{REGENERATE}`; edit the help texts "
           "there, not here (tests/unit/test_config_help.py checks that this file is up to date).", ""]
    for name in section_names():
        doc = section_doc(name)
        out += [f"## {name}", "", *([doc.replace("\n", "\n\n"), ""] if doc else []),
                "| field | type | default | help |", "| --- | --- | --- | --- |"]
        out += [f"| {_cell(r.key, True)} | {_cell(r.type, True)} | {_cell(r.default, True)} | {_cell(r.help)} |"
                for r in field_rows(name)]
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cohort.config.help", description="print or write "
                                     "docs/settings.md, the table of every setting")
    parser.add_argument("--write", metavar="PATH", help="write the markdown to PATH instead of printing it")
    args = parser.parse_args(argv)
    if args.write:
        Path(args.write).write_text(render_markdown(), encoding="utf-8")
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

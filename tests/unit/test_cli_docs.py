"""docs/cli.md cannot drift from the parser: every subcommand has its section, and every option and
positional argument that `cohort <command> --help` prints appears in that section."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cohort.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
COMMANDS = ("train", "eval", "generate", "plot", "serve", "bench")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def section(command: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(rf"^## `cohort {command}`\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/cli.md has no section '## `cohort {command}`'"
    return match.group(1)


def test_every_subcommand_is_documented():
    assert set(subparsers()) == set(COMMANDS), "a subcommand was added or removed: update docs/cli.md and COMMANDS"
    for command in COMMANDS:
        section(command)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_of_the_help_is_documented(command):
    parser = subparsers()[command]
    doc = section(command)
    printed = parser.format_help()
    # what --help prints: option strings (-n, --max-tokens, ...) and positional names
    options = set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", printed))
    options |= {s for a in parser._actions for s in a.option_strings}
    positionals = {a.dest for a in parser._actions if not a.option_strings}
    assert positionals <= set(re.findall(r"\w+", printed))  # (the parser prints them)
    missing = sorted(o for o in options if not re.search(rf"`{re.escape(o)}[` ,]", doc))
    missing += sorted(p for p in positionals if f"`{p}`" not in doc)
    assert not missing, f"docs/cli.md's `cohort {command}` section lacks {missing}: add a row for each"


def test_documented_options_exist():
    """The other way round: an option the page lists in a table row is one the parser knows."""
    for command, parser in subparsers().items():
        known = {s for a in parser._actions for s in a.option_strings}
        rows = re.findall(r"^\| `(-[^` ]+)", section(command), flags=re.M)
        stale = sorted(set(rows) - known)
        assert not stale, f"docs/cli.md documents {stale} for `cohort {command}`, which it does not take"

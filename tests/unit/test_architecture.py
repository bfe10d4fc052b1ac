"""The package's structure, checked on the source: layers only import downwards (import-linter, with a planted
upward import that must fail), no cycle between packages (functions' bodies included), imports inside
functions only for optional dependencies, and the size limits of files and functions (docs/architecture.md)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "cohort"
# What may be imported inside a function: packages of the optional extras, imported only where a feature that
# needs them runs (a CPU install without them still imports every module).
OPTIONAL = ("peft", "datasets", "pyarrow", "reasoning_gym", "math_verify", "PIL", "matplotlib",
            "torch.utils.tensorboard", "flash_attn", "triton", "gguf", "bitsandbytes")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The cohort modules an import statement names (a `from package import submodule` names the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "cohort"]
    if node.level:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "cohort":
        return []
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def _package(module: str) -> str:
    """The layer a module belongs to: its top-level package (or module) under cohort."""
    return ".".join(module.split(".")[:2])


def package_graph(src: Path = SRC) -> dict[str, set[str]]:
    """package -> the packages it imports, from every import statement, those inside functions included."""
    known = _modules(src)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported(module, path, node, known):
                    a, b = _package(module), _package(target)
                    if a != b and a != "cohort" and b != "cohort":
                        graph[a].add(b)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def imports_inside_functions(src: Path = SRC) -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(src.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import | ast.ImportFrom):
                        name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                        out.append((str(path.relative_to(src.parent)), node.lineno, name or ""))
    return sorted(set(out))


def test_the_package_graph_is_acyclic():
    graph = package_graph()
    assert find_cycle(graph) is None, f"import cycle between packages: {' -> '.join(find_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "cohort"
    for name, body in {"__init__.py": "", "a.py": "def f():\n    from cohort import b\n",
                       "b.py": "from cohort.c import x\n", "c.py": "x = 1\nfrom cohort.a import f\n"}.items():
        pkg.mkdir(exist_ok=True)
        (pkg / name).write_text(body)
    assert find_cycle(package_graph(pkg)) == ["cohort.a", "cohort.b", "cohort.c", "cohort.a"]


def test_imports_inside_functions_are_for_optional_dependencies_only():
    lines = {}
    bad = []
    for file, lineno, name in imports_inside_functions():
        if lines.get(file) is None:
            lines[file] = (SRC.parent / file).read_text().splitlines()
        optional = any(name == o or name.startswith(o + ".") for o in OPTIONAL)
        text = lines[file][lineno - 1] + lines[file][lineno - 2]
        if not optional or "optional" not in text:
            bad.append(f"{file}:{lineno} imports {name}")
    assert not bad, ("imports inside functions that are not a commented optional dependency (move them to the "
                     "module's top; a cycle means the code sits in the wrong layer):\n" + "\n".join(bad))


def test_files_and_functions_stay_small():
    too_long = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines")
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {length} lines")
    assert not too_long, "over the limits (400 lines a file, 60 a function):\n" + "\n".join(too_long)


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (requirements/test.txt has it)")
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([exe, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_lint_imports_keeps_the_layers_and_breaks_on_an_upward_import(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(SRC, copy / "src" / "cohort", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    kept = _lint_imports(copy)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    # an upward import hidden in a function's body: algorithms (low) reaching for the trainer (high)
    planted = copy / "src" / "cohort" / "algorithms" / "kl.py"
    planted.write_text(planted.read_text() + "\n\ndef _planted():\n    from cohort.trainer import train\n\n"
                       "    return train\n")
    broken = _lint_imports(copy)
    assert broken.returncode != 0, broken.stdout
    assert "cohort.algorithms.kl -> cohort.trainer" in broken.stdout, broken.stdout


def test_the_test_command_runs_the_layer_contract():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines() if "pytest" in line)
    assert "lint-imports" in command and command.strip() in readme

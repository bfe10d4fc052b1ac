"""No test asserts elapsed wall time (issue 37): such bounds fail on a loaded machine and prove nothing a
behavioural assertion (the result says timed out, the error names the timeout, a client-side timeout on the
call itself) does not. This scans every tests/**/*.py with `ast` for `assert` statements whose expression
calls time.monotonic / time.perf_counter / time.time or timeit.default_timer (under any import name:
`import time as tm`, `from timeit import default_timer as timer`), or reads a name bound from such a call."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

TESTS = Path(__file__).resolve().parents[1]
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
CLOCK_MODULES = {"time": CLOCKS, "timeit": {"default_timer"}}  # module -> its clock functions

# Wall-clock assertions still to be rewritten, as "path::function". Empty since issue 37's last ones were
# rewritten; an entry that no longer asserts wall time fails too, so this list only shrinks.
PENDING: set[str] = set()


class ClockNames(NamedTuple):
    """A file's names for the clocks: functions imported by name, and the clock modules' local names."""

    functions: set[str]  # from time import monotonic (as m)
    modules: dict[str, str]  # import time as tm: tm -> time


def _is_clock_call(node: ast.AST, clock_names: ClockNames) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):  # time.monotonic(), tm.perf_counter()
        module = clock_names.modules.get(func.value.id, func.value.id)
        return func.attr in CLOCK_MODULES.get(module, set())
    return isinstance(func, ast.Name) and func.id in clock_names.functions  # from time import monotonic


def _reads_clock(expr: ast.AST, clock_names: ClockNames, bound: set[str]) -> bool:
    return any(_is_clock_call(n, clock_names) or (isinstance(n, ast.Name) and n.id in bound)
               for n in ast.walk(expr))


def _target_names(target: ast.AST) -> list[str]:
    """The names an assignment binds: `x`, each of `a, b`, and the container of `d[k]` or `o.attr`."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for elt in target.elts for name in _target_names(elt)]
    while isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
        target = target.value
    return [target.id] if isinstance(target, ast.Name) else []


def _scope_findings(scope: ast.AST, clock_names: ClockNames) -> list[tuple[int, str]]:
    """(line, function) of the wall-clock assertions directly in `scope` (nested functions are their own)."""
    nodes, stack = [], list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    bound: set[str] = set()  # names holding a clock reading, or a difference of them (to a fixed point)
    assigns = [n for n in nodes if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr))]
    changed = True
    while changed:
        changed = False
        for node in assigns:
            if node.value is None or not _reads_clock(node.value, clock_names, bound):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in _target_names(target):
                    if name not in bound:
                        bound.add(name)
                        changed = True
    name = getattr(scope, "name", "<module>")
    return [(n.lineno, name) for n in nodes if isinstance(n, ast.Assert) and _reads_clock(n.test, clock_names, bound)]


def wall_clock_asserts(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function) of each assert in `path` that reads the wall clock."""
    tree = ast.parse(path.read_text(), filename=str(path))
    clock_names = ClockNames(
        {alias.asname or alias.name for node in ast.walk(tree)
         if isinstance(node, ast.ImportFrom) and node.module in CLOCK_MODULES
         for alias in node.names if alias.name in CLOCK_MODULES[node.module]},
        {alias.asname: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
         for alias in node.names if alias.name in CLOCK_MODULES and alias.asname})
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return sorted(f for scope in scopes for f in _scope_findings(scope, clock_names))


def scan(root: Path) -> dict[str, list[int]]:
    """{"relative/path.py::function": [lines]} for every wall-clock assertion under `root`."""
    found: dict[str, list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        for line, function in wall_clock_asserts(path):
            found.setdefault(f"{path.relative_to(root).as_posix()}::{function}", []).append(line)
    return found


def test_no_test_asserts_elapsed_wall_time():
    found = scan(TESTS)
    new = {key: lines for key, lines in found.items() if key not in PENDING}
    listing = [f"tests/{key.split('::')[0]}:{line}" for key, lines in new.items() for line in lines]
    assert not listing, "assertions on elapsed wall time (assert the behaviour instead):\n" + "\n".join(listing)
    fixed = sorted(PENDING - set(found))
    assert not fixed, f"no longer asserting wall time; remove from PENDING: {fixed}"


def test_the_scan_finds_a_planted_wall_clock_assertion(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_planted.py").write_text(
        "import time\nfrom time import perf_counter as pc\n\n"
        "def test_direct():\n    t0 = time.monotonic()\n    assert time.monotonic() - t0 < 1\n\n"
        "def test_bound():\n    t0 = pc()\n    took = pc() - t0\n    assert took < 2, took\n\n"
        "def test_stamp():\n    t0 = time.time()\n    assert t0 is not None or True and 1 == 1\n"
        "    assert [1] == [1]\n\n"
        "def test_table(case):\n    times = {}\n    times[case] = time.perf_counter()\n    assert case\n"
        "    assert times[case] < 3\n")
    found = scan(tmp_path)
    assert found == {"sub/test_planted.py::test_direct": [6], "sub/test_planted.py::test_bound": [11],
                     "sub/test_planted.py::test_stamp": [15], "sub/test_planted.py::test_table": [22]}
    (tmp_path / "sub" / "test_clean.py").write_text("import time\n\ndef test_x():\n    time.sleep(0)\n    assert True\n")
    assert "sub/test_clean.py::test_x" not in scan(tmp_path)


def test_the_scan_follows_import_names_and_timeit(tmp_path):
    (tmp_path / "test_aliases.py").write_text(
        "import time as tm\nimport timeit\nfrom timeit import default_timer as timer\n\n"
        "def test_alias():\n    t0 = tm.perf_counter()\n    assert tm.perf_counter() - t0 < 4\n\n"
        "def test_timeit():\n    t0 = timeit.default_timer()\n    assert timeit.default_timer() - t0 < 4\n\n"
        "def test_from_timeit():\n    t0 = timer()\n    assert timer() - t0 < 4\n")
    assert scan(tmp_path) == {"test_aliases.py::test_alias": [7], "test_aliases.py::test_timeit": [11],
                              "test_aliases.py::test_from_timeit": [15]}

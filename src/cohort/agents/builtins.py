"""Built-in tools: a safe calculator and a resource-limited Python runner.

Name them in a recipe or in `GRPOTrainer(tools=[...])` as `cohort.agents.builtins:calculator` and
`cohort.agents.builtins:python`.

`calculator` evaluates arithmetic by walking the expression's `ast`: numbers, `+ - * / // % **`, unary signs and
parentheses. Names, calls, attributes, subscripts, strings and everything else are refused, so no input can
run code; `eval` is never used. Powers and results are bounded (no 9**9**9 that would take the CPU for hours).

`python` runs code in a separate process (`python -I`: no user site-packages, no PYTHON* environment variables,
the script's folder not on sys.path) whose working directory is a fresh temporary folder, deleted afterwards,
with a minimal environment and these limits set in the child before the code runs:
RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space: memory blow-ups raise MemoryError), RLIMIT_FSIZE (largest
file it may write), RLIMIT_NPROC = 0 (no new processes or threads; not enforced for root) and a wall-clock
timeout after which its whole process group is killed. Its output is cut to `max_output_chars`.

This is a resource sandbox, not a security boundary: the code runs as the training user, so it can read any
file that user can read and write, by absolute path, anywhere that user may write (it cannot *start* in the run
directory, and cannot fill the disk past RLIMIT_FSIZE per file); it can open network sockets. Against a
determined attacker add OS isolation: a container or a user namespace with a read-only root and only the temp
folder writable (bubblewrap, nsjail, gVisor, Firecracker), no network namespace, seccomp filters, a separate
unprivileged uid and cgroup limits for memory and process count.
"""

from __future__ import annotations

import ast
import contextlib
import math
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------- calculator
MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_DIGITS = 1000  # integers beyond 10**1000 and exponents that would produce them are refused

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is shown to the model."""


def _digits(x: float | int) -> float:
    return math.log10(abs(x)) if x else 0.0


def _check_size(x: float | int) -> float | int:
    if isinstance(x, int) and _digits(x) > MAX_RESULT_DIGITS:
        raise CalculatorError(f"the result has more than {MAX_RESULT_DIGITS} digits")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    return x


def _power(base: float | int, exp: float | int) -> float | int:
    if abs(base) > 1 and abs(exp) * _digits(base) > MAX_RESULT_DIGITS:
        raise CalculatorError(f"{base} ** {exp} is too large (more than {MAX_RESULT_DIGITS} digits)")
    if base == 0 and exp < 0:
        raise CalculatorError("0 cannot be raised to a negative power")
    result = base ** exp
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return result


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Mult) and _digits(left) + _digits(right) > MAX_RESULT_DIGITS + 1:
            raise CalculatorError(f"the result has more than {MAX_RESULT_DIGITS} digits")
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not a power here; write powers as a ** b")
    what = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
            ast.Subscript: "subscripts"}.get(type(node), type(node).__name__)
    raise CalculatorError(f"{what} are not allowed: only numbers, + - * / // % ** and parentheses")


def _format(x: float | int) -> str:
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.12g}"
    return str(x)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: An arithmetic expression with numbers, parentheses and the operators + - * / // % ** (for example "(12 + 30) * 4 - 7 / 2").
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if text.endswith("="):
        text = text[:-1]
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    try:
        return _format(_eval(tree))
    except OverflowError:
        raise CalculatorError("the result is too large") from None
    except (RecursionError, ZeroDivisionError) as exc:
        raise CalculatorError(f"cannot evaluate: {exc}") from None


# ------------------------------------------------------------------------------------------------------ python
@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 8.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_output_chars: int = 4000


_PRELUDE = """
import resource, runpy, sys
cpu, mem, fsize = {cpu}, {mem}, {fsize}
def limit(name, value):
    what = getattr(resource, name, None)
    if what is None:
        return
    try:
        resource.setrlimit(what, (value, value))
    except (ValueError, OSError):
        pass
limit("RLIMIT_CPU", cpu)
limit("RLIMIT_AS", mem)
limit("RLIMIT_FSIZE", fsize)
limit("RLIMIT_CORE", 0)
limit("RLIMIT_NPROC", 0)
sys.argv = ["main.py"]
del limit, cpu, mem, fsize, resource
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit:
    raise
except BaseException as exc:  # the traceback from the program's own frames, without runpy's
    import traceback
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    cpu_limited: bool
    workdir: str

    def text(self) -> str:
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append(self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append("Error: the code was killed at its wall-clock limit.")
        elif self.cpu_limited:
            parts.append("Error: the code was killed at its CPU-time limit.")
        elif self.returncode not in (0, None) and not self.stderr.strip():
            parts.append(f"Error: the process exited with status {self.returncode}.")
        return "\n".join(parts) if parts else "(no output)"


class PythonSandbox:
    """Run Python source in a child process with resource limits; see the module docstring for what it is not."""

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()

    def run(self, code: str) -> SandboxResult:
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix="cohort-sandbox-")
        logs = tempfile.mkdtemp(prefix="cohort-sandbox-logs-")
        try:
            Path(workdir, "main.py").write_text(code, encoding="utf-8")
            prelude = _PRELUDE.format(cpu=int(lim.cpu_s), mem=int(lim.memory_mb) << 20,
                                      fsize=int(lim.file_size_mb) << 20)
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
                   "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
            with open(Path(logs, "out"), "wb") as out, open(Path(logs, "err"), "wb") as err:
                proc = subprocess.Popen([sys.executable, "-I", "-c", prelude], cwd=workdir, env=env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
                timed_out = False
                try:
                    proc.wait(timeout=lim.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(proc.pid)
                    proc.wait()
            rc = proc.returncode
            cpu_limited = rc in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out
            return SandboxResult(stdout=_head(Path(logs, "out"), lim.max_output_chars),
                                 stderr=_head(Path(logs, "err"), lim.max_output_chars),
                                 returncode=rc, timed_out=timed_out, cpu_limited=cpu_limited, workdir=workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 1)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit:
        text = text[:limit] + f"\n... [output cut at {limit} characters]"
    return text


_DEFAULT_SANDBOX = PythonSandbox()


def python(code: str) -> str:
    """Run a Python program and return what it prints (standard output, then any error).

    Args:
        code: The source code of a complete Python program. Use print() to show results.
    """
    return _DEFAULT_SANDBOX.run(code).text()


def make_python_tool(limits: SandboxLimits):
    """A `python` tool with other limits (same name and schema), e.g. `make_python_tool(SandboxLimits(cpu_s=2))`."""
    sandbox = PythonSandbox(limits)

    def python(code: str) -> str:
        """Run a Python program and return what it prints (standard output, then any error).

        Args:
            code: The source code of a complete Python program. Use print() to show results.
        """
        return sandbox.run(code).text()

    return python

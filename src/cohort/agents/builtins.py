"""Built-in tools: a safe calculator and a resource-limited Python runner.

Name them in a recipe or in `GRPOTrainer(tools=[...])` as `cohort.agents.builtins:calculator` and
`cohort.agents.builtins:python`.

`calculator` evaluates arithmetic by walking the expression's `ast`: numbers, `+ - * / // % **`, unary signs and
parentheses. Names, calls, attributes, subscripts, strings and everything else are refused, so no input can
run code; `eval` is never used. Powers and results are bounded (no 9**9**9 that would take the CPU for hours).

`python` runs a program in a sandbox (`cohort.agents.sandbox`): a child process with resource limits, isolated by
bubblewrap where it can start (no network, a private PID namespace and /proc, a read-only root) and otherwise a
plain process with a warning that says what is not isolated; `COHORT_SANDBOX=auto|bwrap|process` chooses. Its wall
clock is also cut to the time its ToolRunner gives the call (`agent.tool_timeout_s`). docs/agents.md, "Sandbox".
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from cohort.agents.placement import slow_tool
from cohort.agents.sandbox import PythonSandbox, SandboxLimits, SandboxResult
from cohort.agents.tools import tool_time_left

__all__ = ["CalculatorError", "PythonSandbox", "SandboxLimits", "SandboxResult", "calculator", "make_python_tool",
           "python"]

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
_DEFAULT_SANDBOX = PythonSandbox()


def _run_python(sandbox: PythonSandbox, code: str) -> str:
    """Run under the sandbox's limits, and stop when the ToolRunner stops waiting (agent.tool_timeout_s), with
    a moment left to hand back what the program printed; the wall clock is then the smaller of the two."""
    left = tool_time_left()
    return sandbox.run(code, wall_s=None if left is None else max(0.05, left - min(0.5, 0.25 * left))).text()


@slow_tool  # a process per call: agent.inline_tools=auto runs it on the thread pool from the start
def python(code: str) -> str:
    """Run a Python program and return what it prints (standard output, then any error).

    Args:
        code: The source code of a complete Python program. Use print() to show results.
    """
    return _run_python(_DEFAULT_SANDBOX, code)


def make_python_tool(limits: SandboxLimits, mode: str | None = None):
    """A `python` tool with other limits (same name and schema), e.g. `make_python_tool(SandboxLimits(cpu_s=2))`;
    `mode` ("auto", "bwrap", "process") overrides $COHORT_SANDBOX."""
    sandbox = PythonSandbox(limits, mode=mode)

    @slow_tool
    def python(code: str) -> str:
        """Run a Python program and return what it prints (standard output, then any error).

        Args:
            code: The source code of a complete Python program. Use print() to show results.
        """
        return _run_python(sandbox, code)

    return python

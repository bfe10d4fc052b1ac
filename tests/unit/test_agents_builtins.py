"""Built-in tools: the ast calculator refuses anything but arithmetic; the Python sandbox is killed at its limits."""

from __future__ import annotations

import concurrent.futures
import os
import resource
import tempfile

import pytest
from transformers.utils import get_json_schema

from cohort.agents.builtins import CalculatorError, PythonSandbox, SandboxLimits, calculator, python
from cohort.agents.tools import ToolCall, ToolRunner, build_tools


@pytest.mark.parametrize(("expr", "value"), [
    ("12 + 30", "42"), ("(12 + 30) * 4 - 7 / 2", "164.5"), ("-3 // 2", "-2"), ("7 % 3", "1"), ("2 ** 10", "1024"),
    ("-(2 + 3)", "-5"), ("+4", "4"), ("1 / 3", "0.333333333333"), ("2 ** -1", "0.5"), ("10 / 2", "5"),
    ("34 + 56 - 78 + 12 =", "24"), ("3 × 4 ÷ 2", "6"), ("1e3 + 1", "1001"), ("10 ** 999", "1" + "0" * 999),
])
def test_calculator_evaluates(expr, value):
    assert calculator(expr) == value


@pytest.mark.parametrize(("expr", "why"), [
    ("__import__('os').system('echo hi')", "function calls"),
    ("os", "names"), ("x + 1", "names"), ("(1).real", "attributes"), ("[1, 2][0]", "subscripts"),
    ("'a' * 3", "only numbers"), ("True + 1", "only numbers"), ("lambda: 1", "Lambda"),
    ("9 ** 9 ** 9", "too large"), ("10 ** 100000", "too large"), ("(10 ** 600) * (10 ** 600)", "digits"),
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("2 ^ 3", "write powers as a \\*\\* b"),
    ("(-8) ** 0.5", "not a real number"), ("1 +", "not an arithmetic expression"), ("1" * 2000, "longer than"),
    ("10.0 ** 400", "too large"),
])
def test_calculator_refuses(expr, why):
    with pytest.raises(CalculatorError, match=why):
        calculator(expr)


def test_calculator_refuses_hostile_input_before_computing_it():
    def refusal(expr):
        with pytest.raises(CalculatorError) as err:
            calculator(expr)
        return str(err.value)

    pool = concurrent.futures.ThreadPoolExecutor(1)  # a calculation attempted would not return within the minute
    try:
        for expr in ["9**9**9**9", "2**2**2**2**2**2"]:
            assert "too large" in pool.submit(refusal, expr).result(timeout=60)
        assert pool.submit(calculator, "(" * 200 + "1" + ")" * 200).result(timeout=60) == "1"  # deep, not slow
    finally:
        pool.shutdown(wait=False)


def test_builtins_have_schemas_and_run_as_tools():
    tools = build_tools(["cohort.agents.builtins:calculator", "cohort.agents.builtins:python"])
    assert [t.schema for t in tools] == [get_json_schema(calculator), get_json_schema(python)]
    out = ToolRunner(tools).run([ToolCall("calculator", {"expression": "6 * 7"}),
                                 ToolCall("calculator", {"expression": "__import__('os')"}),
                                 ToolCall("python", {"code": "print(sum(range(10)))"})])
    assert [(r.content.strip(), r.failed) for r in out][::2] == [("42", False), ("45", False)]
    assert out[1].failed and "function calls are not allowed" in out[1].content


FAST = SandboxLimits(cpu_s=1, wall_s=5.0, memory_mb=512, file_size_mb=8)


def test_sandbox_runs_in_a_fresh_temporary_folder():
    sandbox = PythonSandbox(FAST)
    code = "import os, sys; print(os.getcwd()); print(sorted(os.listdir('.'))); print(os.environ.get('HOME'))"
    res = sandbox.run(code)
    cwd, listing, home = res.stdout.splitlines()
    assert res.returncode == 0 and cwd == res.workdir == home
    assert os.path.realpath(cwd).startswith(os.path.realpath(tempfile.gettempdir()))
    assert os.path.realpath(cwd) != os.path.realpath(os.getcwd()) and listing == "['main.py']"
    assert not os.path.exists(cwd)  # deleted afterwards
    assert sandbox.run(code).workdir != cwd  # a new one each call


def test_sandbox_relative_writes_stay_in_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = PythonSandbox(FAST).run("open('out.txt', 'w').write('x'); open('../escape_probe_not_here', 'a')")
    assert not (tmp_path / "out.txt").exists()  # relative paths resolve in the sandbox folder, not the caller's
    assert res.returncode is not None


def test_sandbox_file_size_limit():
    res = PythonSandbox(FAST).run("open('big', 'wb').write(b'0' * (100 * 1024 * 1024))")
    assert res.returncode != 0 and "File too large" in res.stderr


def test_sandbox_cpu_limit_kills_an_infinite_loop():
    res = PythonSandbox(FAST).run("while True:\n    pass")
    assert res.cpu_limited or res.timed_out
    assert res.returncode != 0  # killed, not left running
    assert "limit" in res.text()


def test_sandbox_wall_clock_limit_kills_a_sleeper():
    res = PythonSandbox(SandboxLimits(cpu_s=5, wall_s=0.5)).run("import time\ntime.sleep(60)")
    assert res.timed_out and not res.cpu_limited and res.returncode != 0  # cut at 0.5 s, not the 60 s sleep
    assert "wall-clock limit" in res.text()


def test_sandbox_memory_limit():
    res = PythonSandbox(FAST).run("x = bytearray(2 * 1024 ** 3)\nprint('allocated')")
    assert "allocated" not in res.stdout and "MemoryError" in res.stderr


def test_sandbox_output_is_cut_and_errors_reported():
    res = PythonSandbox(SandboxLimits(max_output_chars=100)).run("print('y' * 10000)")
    assert len(res.stdout) < 200 and "output cut" in res.stdout
    text = PythonSandbox(FAST).run("def f():\n    raise ValueError('nope')\nf()").text()
    assert 'File "main.py", line 3' in text and "ValueError: nope" in text and "runpy" not in text


def test_sandbox_environment_is_minimal(monkeypatch):
    monkeypatch.setenv("COHORT_SECRET_PROBE", "s3cret")
    res = PythonSandbox(FAST).run("import os; print(os.environ.get('COHORT_SECRET_PROBE'))")
    assert res.stdout.strip() == "None"


@pytest.mark.skipif(os.geteuid() == 0 or not hasattr(resource, "RLIMIT_NPROC"),
                    reason="RLIMIT_NPROC is not enforced for root")
def test_sandbox_cannot_start_processes():
    res = PythonSandbox(FAST).run("import subprocess; subprocess.run(['true'])\nprint('started')")
    assert "started" not in res.stdout

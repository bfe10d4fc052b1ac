"""The python tool's sandbox (issue 35): nothing the tool's code starts outlives the call, a fork bomb is refused,
the trainer's environment and process are out of reach, and under bubblewrap there is no network.

Each test runs in both modes: `bwrap` where bubblewrap can start here (skipped otherwise, with the install line)
and `process` (the fallback) always. Processes are found by pid through their command line: the code execs
`sleep <token>`, a duration no other process uses, and the test scans /proc for it once the call has returned.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import random
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cohort.agents.builtins import PythonSandbox, SandboxLimits, make_python_tool
from cohort.agents.tools import ToolCall, ToolRunner
from cohort.config.agent_section import AgentConfig
from cohort.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src"


def _bwrap_problem() -> str | None:
    try:  # imported here, so that the process-mode tests also run (and fail) on the code before the sandbox
        from cohort.agents.sandbox import isolation

        isolation("bwrap")
    except (ConfigError, ImportError) as exc:
        return str(exc)
    return None


BWRAP_PROBLEM = _bwrap_problem()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None,
                                 reason=f"bubblewrap cannot start here; apt-get install bubblewrap ({BWRAP_PROBLEM})")
MODES = [pytest.param("bwrap", marks=needs_bwrap), "process"]


@pytest.fixture
def mode(request, monkeypatch) -> str:
    """The mode under test, chosen the way a user does: $COHORT_SANDBOX."""
    monkeypatch.setenv("COHORT_SANDBOX", request.param)
    return request.param


def _token() -> str:
    return f"{60 + random.random():.9f}"


def _alive(token: str) -> list[int]:
    """Pids of live processes whose command line has `token` (zombies have none)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path("/proc", entry, "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if token.encode() in argv:
                pids.append(int(entry))
    return pids


def _returns_within(timeout_s: float, call, *args):
    """`call(*args)`, on a thread; a call still running after `timeout_s` fails the test (TimeoutError)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(call, *args).result(timeout=timeout_s)
    finally:
        pool.shutdown(wait=False)


def _sleeper(token: str) -> str:
    return f'os.execv("/bin/sleep", ["sleep", "{token}"])'


SETSID = """
import os, time
try:
    pid = os.fork()
except OSError as exc:
    print("fork refused:", exc)
else:
    if pid == 0:
        os.setsid()
        {sleeper}
    print("started", pid, flush=True)
time.sleep({main_sleep})
"""

BOMB = """
import os
forked = 0
for _ in range(200):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        {sleeper}
    forked += 1
print("forked", forked)
"""


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_a_setsid_child_is_dead_when_the_call_returns(mode):
    token = _token()
    # cut at its 1.5 s limit, not after the main process's 60 s sleep: a call that waits it out fails by timeout
    res = _returns_within(30, PythonSandbox(SandboxLimits(wall_s=1.5)).run,
                          SETSID.format(sleeper=_sleeper(token), main_sleep=60))
    assert _alive(token) == [], res.stdout + res.stderr
    assert res.timed_out and res.mode == mode
    assert "wall-clock limit" in res.text(), res.text()


@needs_bwrap
@pytest.mark.parametrize("main_sleep", [60, 0], ids=["timed-out", "exited"])
def test_bwrap_kills_the_whole_pid_namespace_even_where_processes_are_allowed(monkeypatch, main_sleep):
    monkeypatch.setenv("COHORT_SANDBOX", "bwrap")
    token = _token()
    res = PythonSandbox(SandboxLimits(wall_s=1.5, processes=16)).run(
        SETSID.format(sleeper=_sleeper(token), main_sleep=main_sleep))
    assert "started" in res.stdout, res.stderr  # the setsid() child ran, in a session of its own
    assert res.timed_out == bool(main_sleep)
    assert _alive(token) == []


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_a_fork_bomb_is_refused_and_returns_at_once(mode):
    token = _token()
    res = _returns_within(30, PythonSandbox(SandboxLimits(wall_s=3.0)).run, BOMB.format(sleeper=_sleeper(token)))
    assert not res.timed_out, res.stdout + res.stderr  # it ended by itself, not at its 3 s limit
    assert "forked 0" in res.stdout, res.stdout + res.stderr
    assert _alive(token) == []


@needs_bwrap
def test_bwrap_bounds_a_fork_bomb_by_processes_and_kills_it(monkeypatch):
    monkeypatch.setenv("COHORT_SANDBOX", "bwrap")
    token = _token()
    res = PythonSandbox(SandboxLimits(wall_s=3.0, processes=8)).run(BOMB.format(sleeper=_sleeper(token)))
    forked = int(res.stdout.split()[-1])
    assert 0 < forked <= 8
    assert _alive(token) == []


STAND_IN = """
import os, sys, types
# cohort.agents.sandbox and what it imports are standard-library only: load them without the packages' __init__
# (which import transformers and torch), so this stand-in trainer starts in a blink.
for name in ("cohort", "cohort.agents"):
    module = types.ModuleType(name)
    module.__path__ = [os.path.join({src!r}, *name.split("."))]
    sys.modules[name] = module
from cohort.agents.sandbox import PythonSandbox, SandboxLimits
CODE = '''
import os, signal
try:
    print("environ:", open("/proc/%d/environ", "rb").read().decode(errors="replace"))
except OSError as exc:
    print("environ refused:", type(exc).__name__)
for pid in (os.getppid(), %d):
    try:
        os.kill(pid, signal.SIGKILL)
        print("kill sent", pid)
    except OSError as exc:
        print("kill refused:", type(exc).__name__)
''' % (os.getpid(), os.getpid())
res = PythonSandbox(SandboxLimits(wall_s=10.0)).run(CODE)
print(res.mode, res.stdout, res.stderr)
print("trainer alive")
"""


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_the_code_can_neither_read_the_trainers_environment_nor_kill_it(mode, tmp_path):
    if mode == "process" and os.geteuid() != 0:
        pytest.skip("process mode as a non-root user runs the code as the trainer's own user, which may read "
                    "/proc/<trainer>/environ and signal it; only bwrap isolates that")
    secret = f"s3cret-{random.getrandbits(64):x}"
    script = tmp_path / "trainer.py"
    script.write_text(STAND_IN.format(src=str(SRC)))
    env = {**os.environ, "COHORT_SANDBOX": mode, "COHORT_TEST_SECRET": secret}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"the stand-in trainer died ({out.returncode}): {out.stdout} {out.stderr}"
    assert out.stdout.startswith(mode) and "trainer alive" in out.stdout
    assert secret not in out.stdout and "kill sent" not in out.stdout, out.stdout


def _connect_code(port: int) -> str:
    return textwrap.dedent(f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
            print("connected")
        except OSError as exc:
            print("no connection:", type(exc).__name__)
    """)


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_network_is_cut_under_bwrap_only(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        res = PythonSandbox(SandboxLimits(wall_s=5.0)).run(_connect_code(server.getsockname()[1]))
        server.setblocking(False)
        if mode == "bwrap":
            assert "no connection" in res.stdout, res.stdout + res.stderr
            with pytest.raises(BlockingIOError):
                server.accept()
        else:  # the fallback leaves the network open, as its warning says; the listener itself works
            assert "connected" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("mode", MODES, indirect=True)
def test_the_python_tool_stops_when_its_runner_times_out(mode):
    assert math.isfinite(AgentConfig().tool_timeout_s) and AgentConfig().tool_timeout_s > 0
    token = _token()
    tool = make_python_tool(SandboxLimits(wall_s=30.0))  # its own limit is far longer than the runner's
    runner = ToolRunner([tool], timeout_s=1.0)
    # back after the runner's 1 s, not the tool's own 30 s: a call that waits for the tool fails by timeout
    [result] = _returns_within(20, runner.run, [ToolCall("python", {"code": "import os\n" + _sleeper(token)})])
    # the sandbox cuts its wall clock to the runner's time (less a moment to hand back the output): normally its
    # own message comes back, and on a loaded machine the runner's; either way the process is gone by then
    assert "wall-clock limit" in result.content or "timed out after 1 s" in result.content, result.content
    for _ in range(100):  # a moment for the kill to land (the sleeper itself would run 60 s)
        if not _alive(token):
            break
        time.sleep(0.05)
    assert _alive(token) == []


def test_an_unknown_mode_is_a_one_line_error_naming_it(monkeypatch):
    monkeypatch.setenv("COHORT_SANDBOX", "docker")
    with pytest.raises(ConfigError, match="COHORT_SANDBOX='docker'") as err:
        PythonSandbox().run("print(1)")
    assert "\n" not in str(err.value)
    [result] = ToolRunner([make_python_tool(SandboxLimits())]).run([ToolCall("python", {"code": "print(1)"})])
    assert result.failed and "COHORT_SANDBOX='docker'" in result.content


def test_process_mode_says_once_what_it_does_not_isolate(monkeypatch, caplog):
    from cohort.agents import sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "_RESOLVED", {})  # settle the mode afresh, as a new trainer would
    monkeypatch.setenv("COHORT_SANDBOX", "process")
    with caplog.at_level(logging.WARNING, logger="cohort.agents.sandbox"):
        for _ in range(2):
            assert PythonSandbox(SandboxLimits(wall_s=5.0)).run("print(2)").stdout.strip() == "2"
    warnings = [r.getMessage() for r in caplog.records if "NOT isolated" in r.getMessage()]
    assert len(warnings) == 1 and "network" in warnings[0] and "apt-get install bubblewrap" in warnings[0]

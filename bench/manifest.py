"""The manifest of a measured run: `bench/results/<date>-<short-name>/manifest.json` (bench/results/README.md).

    from manifest import new_run_folder, write_manifest   # bench/ scripts import their siblings this way
    folder = new_run_folder("serve")                      # bench/results/2026-11-27-serve/ (-b, -c... if taken)
    write_manifest(folder, "cohort serve vs colocated", "python3 bench/serve.py ...", ["serve.json"])
    record_run("what it measured", args.out, args.log)   # a script's own outputs, its own command line

    python3 bench/manifest.py FOLDER --what TEXT --command TEXT [FILE ...]   # from a shell script (default:
                                                                             # every file in FOLDER)

write_manifest fills in what the run cannot be trusted to remember: the date, the commit
(`git rev-parse --short HEAD`, "-dirty" when tracked files differ from it; COHORT_BENCH_COMMIT overrides it on
a machine whose copy of the repository has no .git), the device (`<count>x <torch.cuda.get_device_name()>`, or
"cpu") and the versions of torch, transformers and trl that are installed. Called again on the same folder (a
script run several times into one output folder) it adds the new files and command to the manifest already
there; the first call's date, commit and device stay, and a different commit or device is appended.
`docs_section` is left for whoever reports the run in docs/benchmarks.md to fill in.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
NAME = "manifest.json"
VERSIONED = ("torch", "transformers", "triton", "trl")
REQUIRED = ("date", "what", "command", "device", "commit", "files", "docs_section")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def current_commit() -> tuple[str, str]:
    """(short commit, where it came from) of the code a run measures."""
    if os.environ.get("COHORT_BENCH_COMMIT"):
        return os.environ["COHORT_BENCH_COMMIT"], "COHORT_BENCH_COMMIT"
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown", "no git repository here: set COHORT_BENCH_COMMIT"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return (f"{head}-dirty" if dirty else head), "git rev-parse --short HEAD"


def current_device() -> str:
    """`<count>x <name>` of the visible CUDA devices, else "cpu"."""
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


def installed_versions(names: tuple[str, ...] = VERSIONED) -> dict[str, str]:
    """{package: version} of those installed (as pip sees them, so torch's local tag such as +cu130 included)."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def new_run_folder(short_name: str, date: str | None = None, root: Path = RESULTS) -> Path:
    """A new, empty `<root>/<date>-<short_name>/` (created): a suffix -b, -c, ... when the name is taken."""
    base = f"{date or datetime.date.today().isoformat()}-{short_name}"
    for suffix in ["", *(f"-{chr(c)}" for c in range(ord("b"), ord("z") + 1))]:
        folder = root / f"{base}{suffix}"
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            continue
        return folder
    raise FileExistsError(f"{root / base}: every suffix up to -z is taken")


def _relative(folder: Path, path: str | os.PathLike) -> str:
    """`path` relative to `folder`: as given when it names a file there, else (an absolute path, or one relative
    to the working directory) its path from the folder."""
    p = Path(path)
    if not p.is_absolute() and ((folder / p).exists() or not p.exists()):
        return p.as_posix()
    return Path(os.path.relpath(p.resolve(), folder.resolve())).as_posix()


def _joined(old: str, new: str, sep: str) -> str:
    return old if not new or new in old.split(sep) else f"{old}{sep}{new}" if old else new


def write_manifest(folder: str | os.PathLike, what: str, command: str, files, *, docs_section: str = "") -> Path:
    """Write (or extend) `folder`/manifest.json for a run that wrote `files` (paths relative to `folder`, or
    paths that lie in it) with `command`; returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / NAME
    names = [_relative(folder, f) for f in files]
    commit, commit_source = current_commit()
    device = current_device()
    if path.exists():
        manifest = json.loads(path.read_text())
        manifest["what"] = _joined(manifest.get("what", ""), what, "; ")
        manifest["command"] = _joined(manifest.get("command", ""), command, "\n")
        manifest["commit"] = _joined(manifest.get("commit", ""), commit, ", ")
        manifest["device"] = _joined(manifest.get("device", ""), device, ", ")
        manifest["versions"] = {**installed_versions(), **manifest.get("versions", {})}
        manifest["files"] = list(dict.fromkeys([*manifest.get("files", []), *names]))
        manifest["docs_section"] = manifest.get("docs_section") or docs_section
    else:
        manifest = {"date": datetime.date.today().isoformat(), "what": what, "command": command, "device": device,
                    "commit": commit, "commit_source": commit_source, "versions": installed_versions(),
                    "docs_section": docs_section, "files": list(dict.fromkeys(names))}
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def command_line(argv: list[str] | None = None) -> str:
    """This process's command, as run from the repository root: the COHORT_* variables set (but
    COHORT_BENCH_COMMIT, and never a secret: COHORT_API_KEY and any *_KEY / *TOKEN / *SECRET), python3, the
    script's path from the root and its arguments."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        argv[0] = script.relative_to(ROOT).as_posix()
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("COHORT_") and k != "COHORT_BENCH_COMMIT" and not _secret(k)]
    return " ".join([*env, "python3", *(shlex.quote(a) for a in argv)])


def _secret(name: str) -> bool:
    """Environment variables a results file must never record (the server's key, API tokens)."""
    return name.endswith(("_KEY", "TOKEN", "SECRET"))


def record_run(what: str, *paths: str | os.PathLike | None) -> Path | None:
    """The manifest of a script's own outputs: in the folder of the first of `paths`, listing those of them that
    lie in that folder, with this process's command line. Never raises: a run's results matter more than its
    manifest (a failure is printed and None returned)."""
    given = [Path(p) for p in paths if p]
    if not given:
        return None
    folder = given[0].resolve().parent
    files = [p for p in given if p.exists() and p.resolve().parent == folder]
    try:
        path = write_manifest(folder, what, command_line(), files)
    except Exception as exc:  # see the docstring
        print(f"manifest not written in {folder}: {exc!r}", file=sys.stderr, flush=True)
        return None
    print(f"manifest: {path}", flush=True)
    return path


def folder_files(folder: str | os.PathLike) -> list[str]:
    """Every file under `folder` but its manifest, as paths relative to it (sorted)."""
    folder = Path(folder)
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != NAME)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="write or extend FOLDER/manifest.json (bench/results/README.md)")
    p.add_argument("folder")
    p.add_argument("files", nargs="*", help="the run's files, relative to FOLDER (default: every file in it)")
    p.add_argument("--what", required=True, help="one line: what the run measures")
    p.add_argument("--command", required=True, help="the command that produced the files")
    p.add_argument("--docs-section", default="", help="the heading of docs/benchmarks.md that reports it")
    args = p.parse_args(argv)
    path = write_manifest(args.folder, args.what, args.command, args.files or folder_files(args.folder),
                          docs_section=args.docs_section)
    print(f"manifest: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

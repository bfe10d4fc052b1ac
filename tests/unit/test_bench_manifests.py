"""bench/results/: one folder per measured run, each with a manifest.json that lists exactly its files and says
when, where, at which commit and by which command they were made (bench/results/README.md); every
bench/results/... path the docs cite exists; bench/manifest.py writes such manifests."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from tests.helpers.bench_modules import load_bench

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
REQUIRED = ("date", "what", "command", "device", "commit", "files", "docs_section")
RUNS = sorted(p for p in RESULTS.iterdir() if p.is_dir())
PATH = re.compile(r"bench/results/[^\s`'\")\]]*")


@pytest.fixture(scope="module")
def manifest():
    return load_bench("manifest.py", "bench_manifest")


def _load(folder: Path) -> dict:
    path = folder / "manifest.json"
    assert path.is_file(), f"{folder.name}: no manifest.json"
    return json.loads(path.read_text())


def _headings(doc: Path) -> set[str]:
    return {re.sub(r"^#+ ", "", line) for line in doc.read_text().splitlines() if line.startswith("#")}


def _braces(pattern: str) -> list[str]:
    """Shell brace expansion of `a{b,c}d` (nested or several groups too)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [out for alt in match.group(1).split(",")
            for out in _braces(pattern[:match.start()] + alt + pattern[match.end():])]


def test_results_hold_run_folders_only():
    assert len(RUNS) > 50
    loose = sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")
    assert not loose, f"files outside a run folder: {loose}"


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_every_run_folder_has_a_complete_manifest(folder):
    m = _load(folder)
    for field in REQUIRED:
        assert m.get(field), f"{folder.name}: {field} missing or empty"
        if field != "files":
            assert isinstance(m[field], str) and m[field].strip(), f"{folder.name}: {field}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", m["date"]) and folder.name.startswith(m["date"] + "-"), folder.name
    assert isinstance(m.get("versions", {}), dict)
    listed = m["files"]
    assert len(listed) == len(set(listed)), f"{folder.name}: a file listed twice"
    missing = [f for f in listed if not (folder / f).is_file()]
    assert not missing, f"{folder.name}: listed but not there: {missing}"
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
    unlisted = sorted(present - set(listed))
    assert not unlisted, f"{folder.name}: not in its manifest: {unlisted}"


@pytest.mark.parametrize("folder", RUNS, ids=[p.name for p in RUNS])
def test_docs_section_is_a_heading_of_the_docs(folder):
    section = _load(folder)["docs_section"]
    doc, _, heading = section.partition(": ") if re.match(r"docs/\w+\.md: ", section) else ("docs/benchmarks.md",
                                                                                                "", section)
    assert heading in _headings(ROOT / doc), f"{folder.name}: {section!r} is not a heading of {doc}"


def test_every_results_path_in_the_docs_exists():
    docs = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    cited, missing = 0, []
    for doc in docs:
        for raw in PATH.findall(doc.read_text()):
            path = raw.rstrip(".,;:")
            if "<" in path or "$" in path:  # a template: bench/results/<date>-<name>/...
                continue
            cited += 1
            for pattern in _braces(path):
                if not (any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()):
                    missing.append(f"{doc.relative_to(ROOT)}: {pattern}")
    assert cited > 50
    assert not missing, "\n".join(missing)


def test_brace_expansion():
    assert _braces("a-{b,c}.{txt,json}") == ["a-b.txt", "a-b.json", "a-c.txt", "a-c.json"]
    assert _braces("plain") == ["plain"]


def _expected_device() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"


def test_write_manifest_fills_in_the_run(manifest, tmp_path, monkeypatch):
    monkeypatch.delenv("COHORT_BENCH_COMMIT", raising=False)
    (tmp_path / "out.json").write_text("{}")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run.log").write_text("log")
    path = manifest.write_manifest(tmp_path, "a test run", "python3 bench/x.py --out out.json",
                                   ["out.json", tmp_path / "logs" / "run.log"])
    assert path == tmp_path / "manifest.json"
    m = json.loads(path.read_text())
    assert m["date"] == datetime.date.today().isoformat()
    assert m["what"] == "a test run" and m["command"] == "python3 bench/x.py --out out.json"
    assert m["device"] == _expected_device()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert m["commit"] in (head, f"{head}-dirty") and m["commit_source"] == "git rev-parse --short HEAD"
    assert m["versions"]["torch"] == torch.__version__
    assert m["files"] == ["out.json", "logs/run.log"]
    assert m["docs_section"] == ""  # for whoever reports the run to fill in
    assert set(REQUIRED) <= set(m)


def test_write_manifest_again_extends_it(manifest, tmp_path, monkeypatch):
    monkeypatch.setenv("COHORT_BENCH_COMMIT", "abc1234")
    for name in ("a.json", "b.txt"):
        (tmp_path / name).write_text("x")
    manifest.write_manifest(tmp_path, "first", "cmd one", ["a.json"])
    monkeypatch.setenv("COHORT_BENCH_COMMIT", "def5678")
    manifest.write_manifest(tmp_path, "second", "cmd two", ["b.txt", "a.json"], docs_section="Some heading")
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["files"] == ["a.json", "b.txt"]
    assert m["what"] == "first; second" and m["command"] == "cmd one\ncmd two"
    assert m["commit"] == "abc1234, def5678" and m["commit_source"] == "COHORT_BENCH_COMMIT"
    assert m["device"] == _expected_device() and m["docs_section"] == "Some heading"


def test_record_run_lists_the_outputs_in_the_first_ones_folder(manifest, tmp_path, monkeypatch):
    monkeypatch.setenv("COHORT_BENCH_COMMIT", "abc1234")
    monkeypatch.setenv("COHORT_BENCH_PROFILE_ROWS", "40")
    monkeypatch.setattr("sys.argv", [str(ROOT / "bench" / "grpo_step.py"), "--out", str(tmp_path / "g.json")])
    (tmp_path / "g.json").write_text("{}")
    (tmp_path / "g.log").write_text("")
    elsewhere = tmp_path.parent / f"{tmp_path.name}-other.log"
    elsewhere.write_text("")
    path = manifest.record_run("a step", tmp_path / "g.json", tmp_path / "g.log", elsewhere, None)
    m = json.loads(path.read_text())
    assert m["files"] == ["g.json", "g.log"]
    assert m["command"] == f"COHORT_BENCH_PROFILE_ROWS=40 python3 bench/grpo_step.py --out {tmp_path / 'g.json'}"
    assert manifest.record_run("nothing") is None


def test_new_run_folder_takes_a_free_name(manifest, tmp_path):
    first = manifest.new_run_folder("serve-2gpu", "2026-11-28", root=tmp_path)
    second = manifest.new_run_folder("serve-2gpu", "2026-11-28", root=tmp_path)
    assert first.name == "2026-11-28-serve-2gpu" and second.name == "2026-11-28-serve-2gpu-b"
    assert first.is_dir() and second.is_dir()
    today = manifest.new_run_folder("vlm-tiny", root=tmp_path)
    assert today.name == f"{datetime.date.today().isoformat()}-vlm-tiny"


def test_cli_lists_every_file_of_the_folder(manifest, tmp_path, monkeypatch):
    monkeypatch.setenv("COHORT_BENCH_COMMIT", "abc1234")
    (tmp_path / "sub").mkdir()
    for name in ("profile.txt", "sub/floor.txt"):
        (tmp_path / name).write_text("x")
    assert manifest.main([str(tmp_path), "--what", "w", "--command", "bash bench/update_floor.sh"]) == 0
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["files"] == ["profile.txt", "sub/floor.txt"] and m["commit"] == "abc1234"


def test_a_recorded_command_never_holds_a_secret(manifest, monkeypatch):
    """The serving tests put COHORT_API_KEY in the environment; a results file must not record it."""
    monkeypatch.setenv("COHORT_API_KEY", "s3cret-key")
    monkeypatch.setenv("COHORT_HUB_TOKEN", "s3cret-token")
    monkeypatch.setenv("COHORT_BENCH_PROFILE_ROWS", "40")
    command = manifest.command_line([str(ROOT / "bench" / "grpo_step.py")])
    assert "s3cret" not in command and "COHORT_BENCH_PROFILE_ROWS=40" in command

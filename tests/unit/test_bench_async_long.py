"""bench/async_long.py on the CPU: every row trains on the same prompts with the same drawn lengths (fixed by seed,
rank and chunk, clipped to [min, cap]), the rows parse, and the table averages the measured steps (not the warm-up
nor an asynchronous run's drain) and marks the best asynchronous row against `sync`."""

from __future__ import annotations

import argparse

import pytest
from tests.helpers.bench_modules import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("async_long.py", "async_long_bench")


def _args(bench, *extra: str) -> argparse.Namespace:
    return bench.parse_args(["--device", "cpu", "--prompts", "4", "--generations", "8", *extra])


def test_lengths_belong_to_rank_and_chunk_and_stay_in_bounds(bench):
    args = _args(bench)
    first = bench.chunk_lengths(args, rank=1, chunk=3)
    assert first == bench.chunk_lengths(args, rank=1, chunk=3) and len(first) == 32
    assert first != bench.chunk_lengths(args, rank=0, chunk=3) != bench.chunk_lengths(args, rank=1, chunk=2)
    many = [x for c in range(200) for x in bench.chunk_lengths(args, rank=0, chunk=c)]
    assert min(many) == 64 and max(many) == 8192  # clipped at both ends, as issue 34's workload says


def test_rows_and_step_counts(bench):
    assert bench.staleness_of("sync") is None and bench.staleness_of("async4") == 4
    with pytest.raises(SystemExit, match="unknown row"):
        bench.staleness_of("async")
    args = _args(bench, "--rows", "sync,async2", "--warmup", "1", "--steps", "3")
    assert bench.total_steps(args) == 6  # + the drain of async2, in every row


def test_summary_and_table(bench):
    args = _args(bench, "--gpus", "2", "--warmup", "1", "--steps", "2", "--prompt-len", "10")
    prompt = 2 * 4 * 8 * 10  # per step, both ranks
    history = [{"num_tokens": 1000 * (i + 1) + prompt * (i + 1), "step_time": t, "time/generate": 0.0,
                "time/update": 0.0} for i, t in enumerate([9.0, 1.0, 1.0, 7.0])]
    s = bench.summarise(args, history, gpus=2)
    assert s["measured_steps"] == 2 and s["step"] == 1.0 and s["sampled_tok_s"] == 1000.0
    fast = dict(s, tok_s=2 * s["tok_s"])
    text = bench.table([{"row": "sync", "summary": s}, {"row": "async1", "summary": fast},
                        {"row": "async2", "status": "exit 1", "error": "boom"}])
    assert "| async1 (best async) |" in text and "| 2.00x |" in text and "boom" in text

"""Calls started together on threads: what the concurrency tests of the server and its coalescer need."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_at_once(calls: list[Callable[[], Any]], timeout_s: float) -> list[Any]:
    """Run each call on its own thread, all released by one barrier; returns, in call order, each call's
    result or the exception it raised. Fails if a thread is still running after timeout_s."""
    start = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def worker(k: int) -> None:
        start.wait()
        try:
            results[k] = calls[k]()
        except Exception as exc:  # handed to the test, which checks it
            results[k] = exc

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    stuck = [k for k, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"calls {stuck} still running after {timeout_s} s"
    return results

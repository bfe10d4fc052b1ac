"""A weight push watched: the server's liveness checked while the trainer waits on it.

A push is HTTP calls around collectives with the server. A collective whose peer died or froze does not
fail by itself soon enough: gloo waits for its timeout, and NCCL spins on the GPU until its watchdog tears
the whole trainer down after the group timeout, with a message that names neither the server nor what was
going on. So `run_watched` runs the push in a worker thread while the calling thread asks the server's
`/health` every `poll_s`. Once the server has left `/health` unanswered for `timeout_s`
(`generation.server_liveness_timeout_s`), it aborts the weight group (NCCL's kernels return, gloo's wait
ends) and raises `ServerUnavailable` naming host, port and phase.

A collective that cannot be cancelled (`must_return`: NCCL, where the trainer's GPU stream waits behind the
broadcast, so nothing after it could run) and that has not returned `grace_s` after the abort leaves the
process unusable: the error is printed to stderr and the process exits with `EXIT_SERVER_LOST`, never a hang
and never only NCCL's watchdog abort.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from cohort.remote.errors import ServerError, ServerUnavailable

T = TypeVar("T")

EXIT_SERVER_LOST = 75  # EX_TEMPFAIL: the server went away; restart it (and resume the run)

# Set once this process aborted an NCCL weight group. Measured on 2 H100s: with the server frozen (SIGSTOP)
# mid-push the abort makes the push return and ServerUnavailable is raised in time, but the process then
# never finishes exiting (the interpreter's teardown waits on the aborted communicator). The CLI checks
# this after printing the error and leaves with os._exit(EXIT_SERVER_LOST) instead.
_NCCL_ABORTED = threading.Event()


def mark_nccl_aborted() -> None:
    _NCCL_ABORTED.set()


def nccl_group_aborted() -> bool:
    return _NCCL_ABORTED.is_set()


def run_watched(work: Callable[[threading.Event], T], client, *, phase: str, timeout_s: float,
                poll_s: float = 1.0, abort: Callable[[], None] | None = None,
                must_return: bool | Callable[[], bool] = False, grace_s: float = 10.0) -> T:
    """`work(cancelled)`'s result (or its error), computed in a worker thread while this thread polls
    `client`'s /health (`must_return` may be a callable, asked when the server is declared gone). When the server has not answered for `timeout_s`: set `cancelled` (work checks it
    before its next request), call `abort`, and raise ServerUnavailable; with `must_return`, exit the process
    if the worker is still stuck `grace_s` after the abort."""
    box: dict[str, object] = {}
    cancelled = threading.Event()

    def target() -> None:
        try:
            box["value"] = work(cancelled)
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    worker = threading.Thread(target=target, name="cohort-weight-push", daemon=True)
    worker.start()
    last_answer, reason = time.monotonic(), "no answer yet"
    probe_s = max(0.5, min(5.0, timeout_s / 2))
    while True:
        worker.join(poll_s)
        if not worker.is_alive():
            break
        try:
            client.request("GET", "/health", phase=phase, timeout_s=probe_s)
            last_answer = time.monotonic()
        except ServerError as exc:
            cause = exc.__cause__
            reason = (f"/health did not answer within {probe_s:g} s" if isinstance(cause, TimeoutError)
                      else str(getattr(cause, "reason", cause) or exc))
        silent = time.monotonic() - last_answer
        if silent >= timeout_s:
            cancelled.set()
            error = ServerUnavailable(
                f"{client.where} stopped answering during {phase}: no answer to /health for {silent:.0f} s "
                f"(generation.server_liveness_timeout_s={timeout_s:g}; last: {reason}). The push was abandoned "
                "and the server keeps its previous version; restart `cohort serve` (the trainer re-pushes to a "
                "restarted server)")
            _abandon(worker, abort, must_return() if callable(must_return) else must_return, grace_s, error)
            raise error
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _abandon(worker: threading.Thread, abort: Callable[[], None] | None, must_return: bool, grace_s: float,
             error: Exception) -> None:
    if abort is not None:
        with contextlib.suppress(Exception):  # an abort that fails leaves the grace period to decide
            abort()
    if not must_return:
        return  # the worker ends on its own timeout; nothing of this process waits on it
    worker.join(grace_s)
    if worker.is_alive():
        print(f"cohort: {error}. The weight broadcast could not be cancelled (the GPU stream waits on it), so "
              f"this process exits with code {EXIT_SERVER_LOST}", file=sys.stderr, flush=True)
        os._exit(EXIT_SERVER_LOST)

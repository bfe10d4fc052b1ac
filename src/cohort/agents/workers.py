"""The threads that run sync tool calls, and the deadline a tool can read while it runs.

`ToolRunner` (cohort.agents.tools) hands each sync call to a reused daemon worker (`WORKERS`) or, inside an event
loop, to a daemon thread of its own (`in_daemon_thread`); `run_sync` drives a coroutine from sync code. While a call
runs, `tool_time_left()` gives the seconds until its runner stops waiting for it, so a tool with a process of its
own (the `python` built-in) can stop it at the same time instead of running on unseen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("cohort_tool_deadline", default=None)


def tool_time_left() -> float | None:
    """Inside a tool run by a `ToolRunner`: seconds until the runner gives up on this call (its `timeout_s`);
    None when the tool was called some other way."""
    deadline = _DEADLINE.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@contextlib.contextmanager
def tool_deadline(deadline: float) -> Iterator[None]:
    """Within the block (in this thread or task), `tool_time_left()` counts down to `deadline` (monotonic)."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _call_until(fn: Callable[..., Any], deadline: float, kwargs: dict[str, Any]) -> Any:
    with tool_deadline(deadline):
        return fn(**kwargs)


def run_sync(coro):
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["out"] = asyncio.run(coro)
        except BaseException as exc:  # pragma: no cover - re-raised below
            box["err"] = exc

    t = threading.Thread(target=target, name="cohort-tool-runner", daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


class TimedFuture(concurrent.futures.Future):
    """A worker's future that also tells how long the call itself ran (`seconds`, once it is done): the tool's
    own duration, without the wait for a worker to pick it up (agent.inline_tools=auto reads it)."""

    seconds: float | None = None


class _DaemonWorkers:
    """Reused daemon threads for sync tool calls: a call goes to an idle worker, else to a new one. A worker
    whose call timed out stays busy until the call returns (a thread cannot be stopped) and never blocks the
    interpreter's exit; a worker idle for `idle_s` seconds ends."""

    def __init__(self, idle_s: float = 60.0) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._idle_s = idle_s

    def submit(self, fn: Callable[..., Any], kwargs: dict[str, Any], deadline: float) -> TimedFuture:
        """Run `fn(**kwargs)` on a worker; `tool_time_left()` inside it counts down to `deadline`."""
        future = TimedFuture()
        with self._lock:
            start = self._idle == 0
            if not start:
                self._idle -= 1  # that worker will take this job
        self._jobs.put((future, fn, kwargs, deadline))
        if start:
            threading.Thread(target=self._work, name=f"cohort-tool-{getattr(fn, '__name__', 'fn')}",
                             daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            try:
                future, fn, kwargs, deadline = self._jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # nobody counts on this worker: end it
                        self._idle -= 1
                        return
                continue
            if future.set_running_or_notify_cancel():
                start = time.perf_counter()
                try:
                    value = _call_until(fn, deadline, kwargs)
                except Exception as exc:
                    future.seconds = time.perf_counter() - start
                    future.set_exception(exc)
                except BaseException as exc:  # SystemExit & co. from a tool: an error for the model, not for us
                    future.seconds = time.perf_counter() - start
                    future.set_exception(RuntimeError(f"{type(exc).__name__}: {exc}"))
                else:
                    future.seconds = time.perf_counter() - start
                    future.set_result(value)
            with self._lock:
                self._idle += 1


WORKERS = _DaemonWorkers()


def in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any], deadline: float) -> asyncio.Future:
    """Run a sync function on a daemon thread (a hung tool never blocks interpreter exit, unlike a pool's)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any):
        if fut.done():
            return  # timed out already: drop the late result
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target():
        try:
            value = _call_until(fn, deadline, kwargs)
        except Exception as exc:
            ok, value = False, exc
        except BaseException as exc:  # SystemExit & co. from a tool: an error for the model, not for us
            ok, value = False, RuntimeError(f"{type(exc).__name__}: {exc}")
        else:
            ok = True
        with contextlib.suppress(RuntimeError):  # the loop closed while the tool ran
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=target, name=f"cohort-tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut

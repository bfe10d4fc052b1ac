"""The time limit on one reward function call (`reward.timeout_s`): `call_with_limit(fn, kwargs, limit_s)`.

In the main thread, where the trainer scores its rollouts, the function runs in place and a watchdog thread
interrupts it when the limit passes: it sends SIGUSR2 to the main thread, whose handler (installed for the
call only) raises `LimitExpired` inside the function. That is a BaseException, so the function's own `except
Exception` does not swallow it. Running in place keeps what works without a limit working: libraries that time
themselves with `signal.alarm` (math-verify's parse and verify timeouts, a user's code runner) need the main
thread, and a function that overruns is stopped rather than left running beside the training.

Where that cannot work (another thread, a platform without `pthread_kill`, or an application that handles
SIGUSR2 itself), the function runs in a daemon helper thread instead, and the caller stops waiting at the
limit; the helper cannot be stopped and is abandoned. A function blocked in C code that never returns to
Python is not interrupted in place either; the limit then applies when it returns.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

Outcome = tuple[str, Any]  # ("ok", value) | ("error", exception) | ("timeout", None)
_SIGNAL = getattr(signal, "SIGUSR2", None)


class LimitExpired(BaseException):
    """Raised inside a reward function (main thread) when its time limit has passed."""


def call_with_limit(fn: Callable[..., Any], kwargs: dict[str, Any], limit_s: float | None, name: str = "") -> Outcome:
    """Call `fn(**kwargs)`; an exception comes back as ("error", exc), an overrun as ("timeout", None)."""
    if limit_s is None:
        return _call(fn, kwargs)
    if _SIGNAL is not None and _can_interrupt(_SIGNAL):
        return _in_place(fn, kwargs, limit_s, _SIGNAL)
    return _in_helper_thread(fn, kwargs, limit_s, name)


def _call(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Outcome:
    try:
        return "ok", fn(**kwargs)
    except Exception as e:
        return "error", e


def _can_interrupt(sig: signal.Signals) -> bool:
    return (hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread()
            and signal.getsignal(sig) in (signal.SIG_DFL, None))


class _Watchdog:
    """Sends the signal once, at the limit, unless disarmed first; the handler raises at most once."""

    def __init__(self, limit_s: float, sig: signal.Signals):
        self.armed, self.fired, self._signal = True, False, sig
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._target = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, args=(limit_s,), name="cohort-reward-limit", daemon=True)

    def _watch(self, limit_s: float) -> None:
        if self._done.wait(limit_s):
            return
        with self._lock:
            if self.armed and self._target is not None:
                self.fired = True
                signal.pthread_kill(self._target, self._signal)

    def handler(self, signum: int, frame: Any) -> None:
        if self.armed:  # a signal that arrives after the call ended does nothing
            self.armed = False
            raise LimitExpired

    def start(self) -> None:
        self._thread.start()

    def disarm(self) -> None:
        with self._lock:
            self.armed = False
        self._done.set()


def _in_place(fn: Callable[..., Any], kwargs: dict[str, Any], limit_s: float, sig: signal.Signals) -> Outcome:
    dog = _Watchdog(limit_s, sig)
    previous = signal.signal(sig, dog.handler)
    try:
        try:
            dog.start()
            try:
                outcome = _call(fn, kwargs)
            finally:
                dog.disarm()
        except LimitExpired:  # in the function, or while disarming just after it returned
            return "timeout", None
        # a function that caught LimitExpired and went on still took longer than its limit
        return ("timeout", None) if dog.fired else outcome
    finally:
        signal.signal(sig, signal.SIG_DFL if previous is None else previous)


def _in_helper_thread(fn: Callable[..., Any], kwargs: dict[str, Any], limit_s: float, name: str) -> Outcome:
    box: dict[str, Outcome] = {}

    def target() -> None:
        box["outcome"] = _call(fn, kwargs)

    # A daemon thread: a function that never returns cannot be killed, but must not block exit either.
    thread = threading.Thread(target=target, name=f"reward-{name or 'function'}", daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        return "timeout", None
    return box["outcome"]

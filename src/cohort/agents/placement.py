"""Where the turn loop runs a turn's tool calls: on the engine's thread or on its thread pool (agent.inline_tools).

    True    every turn's calls run inline: on the engine's thread, between two engine steps
    False   every turn's calls run on the thread pool while the engine keeps generating the other sequences
    "auto"  (the default) inline while the tools are quick, on the pool for a tool once it proved slow

Why auto decides by a tool's measured duration: the pool costs the engine's loop host time on every round of
calls (the pool's workers take the GIL to render and tokenise the results, and each PyTorch call of the engine's
loop that released it may wait a whole switch interval to get it back), about 2 ms a round on an H200 (bench/turns.py:
0.92 s against 0.48 s a step inline, over ~210 rounds of calculator calls); a call run inline stalls every
sequence for as long as it takes. So a tool is worth running inline while its calls take under `SLOW_CALL_S`
(2 ms, that break-even; a calculator call takes ~0.02 ms). A tool moves to the pool for good after `SLOW_IN_A_ROW`
(2) calls in a row over it (one slow call may be a garbage-collector pause or the OS scheduling something else),
or at once after one call over `VERY_SLOW_CALL_S` (50 ms, or a timeout). A call's duration is its own, measured
on the worker thread that ran it (`ToolResult.seconds`): the hand-off between threads, which a loaded machine
can stretch to milliseconds, is not the tool's; nor are the garbage collector's pauses in that time (`GcClock`:
a full collection of a large process takes 100-200 ms, whichever thread it lands in, and moved a 20 us
calculator to the pool in tests before it was taken out). Two kinds start on the pool, without a first slow call inline:
`async def` tools (they await I/O by design) and tools marked `slow_tool` (the sandboxed `python` built-in: a
process per call). Unknown tool names and malformed calls are answered at once with an error: they run inline.

The plan is logged once (INFO) when the loop is built, and each move to the pool once (WARNING, with the call's
duration): `logging.getLogger("cohort.agents")`. `ToolPlacement.modes` holds each tool's place and the reason.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

AUTO = "auto"
SLOW_CALL_S = 0.002
SLOW_IN_A_ROW = 2
VERY_SLOW_CALL_S = 0.05
INLINE, POOL = "inline", "pool"
_SLOW_MARK = "__cohort_slow_tool__"
_LOG = logging.getLogger("cohort.agents.placement")

F = TypeVar("F", bound=Callable[..., Any])


def slow_tool(fn: F) -> F:
    """Mark a tool whose calls take more than a few milliseconds (a subprocess, a network request, a sandbox):
    under agent.inline_tools=auto its calls run on the thread pool from the first one, instead of stalling the
    engine once to find out. Works on functions and on an environment's methods (decorate the method)."""
    fn.__dict__[_SLOW_MARK] = True
    return fn


def check_inline_tools(value: Any) -> bool | str:
    """`value` if it is one of True, False, "auto", else a ValueError that lists them."""
    if isinstance(value, bool) or value == AUTO:
        return value
    raise ValueError(f"inline_tools={value!r}: use True (tools run on the engine's thread), False (on a thread "
                     "pool) or 'auto' (on the engine's thread while each call takes under 2 ms)")


class ToolPlacement:
    """Decides, per turn, whether its calls run inline, and (auto) learns from the durations of inline calls.
    Only the engine's thread calls `inline` and `record`, so it needs no lock."""

    def __init__(self, mode: bool | str, tools: Sequence[Any], slow_call_s: float = SLOW_CALL_S) -> None:
        self.mode = check_inline_tools(mode)
        self.slow_call_s = slow_call_s
        self.modes: dict[str, tuple[str, str]] = {}  # auto: tool name -> (INLINE | POOL, why)
        self._in_a_row: dict[str, int] = {}
        if self.mode == AUTO:
            self._plan(tools)

    def _plan(self, tools: Sequence[Any]) -> None:
        for tool in tools:
            if getattr(tool, "is_async", False):
                self.modes[tool.name] = (POOL, "an async tool (awaits I/O)")
            elif getattr(getattr(tool, "function", None), _SLOW_MARK, False):
                self.modes[tool.name] = (POOL, "marked slow_tool")
            else:
                self.modes[tool.name] = (INLINE, f"while each call takes under {self.slow_call_s * 1e3:g} ms")
        if self.modes:
            _LOG.info("agent.inline_tools=auto: %s", "; ".join(
                f"{name} on the {'engine thread' if where == INLINE else 'thread pool'} ({why})"
                for name, (where, why) in self.modes.items()))

    def inline(self, calls: Sequence[Any]) -> bool:
        """Whether this turn's calls run on the engine's thread."""
        if self.mode != AUTO:
            return bool(self.mode)
        return all(self.modes.get(c.name, (INLINE, ""))[0] == INLINE for c in calls)

    def record(self, calls: Sequence[Any], results: Sequence[Any], turn_seconds: float,
               gc_seconds: float = 0.0) -> None:
        """An inline turn's `calls` gave `results` (auto only): each call's own duration (`ToolResult.seconds`,
        the call alone, without the hand-off to a worker thread) counts for its tool; a result without one (a
        runner of another kind) counts the whole turn's `turn_seconds`. Less `gc_seconds`, the garbage
        collector's time during the turn (`GcClock`)."""
        if self.mode != AUTO:
            return
        took: dict[str, float] = {}
        for i, call in enumerate(calls):
            seconds = getattr(results[i], "seconds", None) if i < len(results) else None
            seconds = max(0.0, (turn_seconds if seconds is None else seconds) - gc_seconds)
            if self.modes.get(call.name, (POOL, ""))[0] == INLINE:  # unknown names, malformed calls: never moved
                took[call.name] = max(took.get(call.name, 0.0), seconds)
        for name, seconds in took.items():
            slow = seconds > self.slow_call_s
            self._in_a_row[name] = self._in_a_row.get(name, 0) + 1 if slow else 0
            if seconds > VERY_SLOW_CALL_S or self._in_a_row[name] >= SLOW_IN_A_ROW:
                why = (f"a call took {seconds * 1e3:.1f} ms" if seconds > VERY_SLOW_CALL_S else
                       f"{SLOW_IN_A_ROW} calls in a row took over {self.slow_call_s * 1e3:g} ms, the last "
                       f"{seconds * 1e3:.1f} ms")
                self.modes[name] = (POOL, why)
                _LOG.warning("agent.inline_tools=auto: tool %r now runs on the thread pool: %s on the engine's "
                             "thread, stalling generation (agent.inline_tools=false starts it there)", name, why)


class GcClock:
    """Within the block, `seconds` adds up the garbage collector's running time, in any thread (a pause holds
    the GIL: it is the interpreter's, not the tool's). A callback only for the block's length: collections
    elsewhere pay nothing."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start:  # (a collection that began before the block is not counted)
            self.seconds += time.perf_counter() - self._start
            self._start = 0.0

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)

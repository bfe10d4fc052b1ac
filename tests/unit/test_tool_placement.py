"""agent.inline_tools=auto (cohort.agents.placement): which tools start on the engine's thread, when one moves to
the thread pool, and the setting's values. The durations are handed to `record` as numbers: nothing here waits.
tests/integration/test_turn_loop_placement.py runs the turn loop with a quick and a slow tool."""

from __future__ import annotations

import gc
import logging

import pytest
from tests.helpers.tools import add, hang

from cohort.agents import slow_tool
from cohort.agents.builtins import calculator, python
from cohort.agents.placement import SLOW_CALL_S, VERY_SLOW_CALL_S, GcClock, ToolPlacement, check_inline_tools
from cohort.agents.tools import INVALID_TOOL_NAME, ToolCall, ToolResult, ToolRunner, build_tools
from cohort.config import CohortConfig, apply_overrides
from cohort.errors import ConfigError


async def fetch(url: str) -> str:
    """Fetch a page.

    Args:
        url: The address.
    """
    return url


@slow_tool
def search(query: str) -> str:
    """Search the web.

    Args:
        query: What to look for.
    """
    return query


def calls(*names):
    return [ToolCall(name, {}) for name in names]


def record(placement, names, seconds):
    """A turn that called `names`, each call taking `seconds` on its worker (as ToolRunner measures it)."""
    placement.record(calls(*names), [ToolResult(n, "ok", seconds=seconds) for n in names], seconds)


def where(placement, name):
    return placement.modes[name][0]


def test_auto_starts_quick_tools_inline_and_async_or_marked_ones_on_the_pool(caplog):
    with caplog.at_level(logging.INFO, logger="cohort.agents"):
        placement = ToolPlacement("auto", build_tools([calculator, python, fetch, search]))
    assert {name: where(placement, name) for name in placement.modes} == {
        "calculator": "inline", "python": "pool", "fetch": "pool", "search": "pool"}
    assert "async" in placement.modes["fetch"][1] and "slow_tool" in placement.modes["python"][1]
    assert placement.inline(calls("calculator")) and placement.inline(calls("calculator", "nope"))
    assert not placement.inline(calls("calculator", "search"))  # one turn, one place: the pool
    assert placement.inline(calls(INVALID_TOOL_NAME))  # answered with an error at once
    assert "calculator on the engine thread" in caplog.text and "python on the thread pool" in caplog.text


def test_a_tool_moves_to_the_pool_after_two_slow_calls_in_a_row(caplog):
    placement = ToolPlacement("auto", build_tools([calculator]))
    slow, quick = 2 * SLOW_CALL_S, SLOW_CALL_S / 20
    for seconds in (quick, slow, quick, slow, quick, quick):  # one slow call at a time: a hiccup, not a slow tool
        record(placement, ["calculator"], seconds)
    assert where(placement, "calculator") == "inline"
    with caplog.at_level(logging.WARNING, logger="cohort.agents"):
        record(placement, ["calculator"], slow)
        assert where(placement, "calculator") == "inline" and not caplog.records
        record(placement, ["calculator"], slow)
    assert where(placement, "calculator") == "pool" and not placement.inline(calls("calculator"))
    assert "2 calls in a row" in placement.modes["calculator"][1]
    assert "'calculator' now runs on the thread pool" in caplog.text
    record(placement, ["calculator"], quick)  # (a pooled call is never recorded; nor does it move back)
    assert where(placement, "calculator") == "pool"


def test_one_very_slow_call_moves_its_tool_at_once_and_each_call_counts_for_its_own_tool():
    placement = ToolPlacement("auto", build_tools([calculator, add]))
    turn = calls("calculator", "add", "unknown")
    placement.record(turn, [ToolResult("calculator", "1", seconds=SLOW_CALL_S / 20),
                            ToolResult("add", "2", seconds=VERY_SLOW_CALL_S * 1.5),
                            ToolResult("unknown", "Error", failed=True)], VERY_SLOW_CALL_S * 1.5)
    assert where(placement, "calculator") == "inline" and where(placement, "add") == "pool"
    assert "unknown" not in placement.modes
    assert "a call took 75.0 ms" in placement.modes["add"][1]
    # a runner that gives no durations: the turn's time counts for each tool it called
    placement.record(calls("calculator"), [ToolResult("calculator", "1")], VERY_SLOW_CALL_S * 2)
    assert where(placement, "calculator") == "pool"


def test_garbage_collection_during_a_turn_is_not_the_tools_time():
    """A full collection of a large process takes 100-200 ms in whichever thread it lands: during a 20 us
    calculator call it must not move the calculator to the pool."""
    placement = ToolPlacement("auto", build_tools([calculator]))
    placement.record(calls("calculator"), [ToolResult("calculator", "1", seconds=0.16)], 0.16, gc_seconds=0.159)
    record(placement, ["calculator"], 2 * SLOW_CALL_S)  # (not 2 slow calls in a row)
    assert where(placement, "calculator") == "inline"
    with GcClock() as clock:
        assert clock in gc.callbacks
        gc.collect()
    assert clock not in gc.callbacks and clock.seconds > 0
    idle = GcClock()
    idle("stop", {})  # a collection that began before the block
    assert idle.seconds == 0


def test_the_tool_runner_times_each_call_on_its_worker():
    runner = ToolRunner([calculator, hang], timeout_s=0.05)
    quick, late, bad = runner.run([ToolCall("calculator", {"expression": "1 + 2"}), ToolCall("hang", {"seconds": 1}),
                                   ToolCall("calculator", {"nope": 1})])
    assert quick.content == "3" and quick.seconds is not None and quick.seconds >= 0
    assert late.failed and late.seconds == 0.05  # a timed-out call ran at least its timeout
    assert bad.failed and bad.seconds is None  # bad arguments: it never ran
    assert quick == ToolResult("calculator", "3")  # results compare by what the model reads


@pytest.mark.parametrize("mode", [True, False])
def test_true_and_false_keep_their_meaning_whatever_the_durations(mode):
    placement = ToolPlacement(mode, build_tools([calculator, fetch]))
    for _ in range(3):
        record(placement, ["calculator"], 1.0)
    assert placement.modes == {}
    assert placement.inline(calls("calculator")) is mode and placement.inline(calls("fetch")) is mode


def test_inline_tools_values():
    assert [check_inline_tools(v) for v in (True, False, "auto")] == [True, False, "auto"]
    for bad in ("sometimes", 1, None):
        with pytest.raises(ValueError, match="inline_tools"):
            check_inline_tools(bad)
    assert CohortConfig().agent.inline_tools == "auto"
    for value, expected in (("auto", "auto"), ("true", True), ("false", False)):
        cfg = apply_overrides(CohortConfig(), [f"agent.inline_tools={value}"])
        cfg.validate()
        assert cfg.agent.inline_tools == expected
    with pytest.raises(ConfigError, match=r"agent\.inline_tools"):
        apply_overrides(CohortConfig(), ["agent.inline_tools=sometimes"]).validate()

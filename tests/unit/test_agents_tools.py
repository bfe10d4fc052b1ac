"""Tools: schemas through transformers' get_json_schema, clear errors, and the runner's concurrency, timeouts and errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from transformers.utils import get_json_schema

from cohort.agents.tools import Tool, ToolCall, ToolResult, ToolRunner, build_tools, tool_schemas
from cohort.errors import ConfigError


def multiply(a: int, b: float = 2.0) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def no_doc(a: int) -> int:
    return a


def no_hints(a):
    """Echo.

    Args:
        a: Anything.
    """
    return a


async def slow_async(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    await asyncio.sleep(seconds)
    return f"slept {seconds}"


def slow_sync(seconds: float) -> str:
    """Sleep in a thread, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


_MEETING = {"arrived": 0, "lock": threading.Condition()}


def _arrive() -> None:
    with _MEETING["lock"]:
        _MEETING["arrived"] += 1
        _MEETING["lock"].notify_all()


def meet_sync(parties: int) -> str:
    """Wait in a thread until `parties` tool calls have arrived: only calls that run together all meet.

    Args:
        parties: How many calls to wait for.
    """
    _arrive()
    with _MEETING["lock"]:
        met = _MEETING["lock"].wait_for(lambda: _MEETING["arrived"] >= parties, timeout=60)
    return f"met {parties}" if met else "alone"


async def meet_async(parties: int) -> str:
    """Wait on the event loop until `parties` tool calls have arrived.

    Args:
        parties: How many calls to wait for.
    """
    _arrive()
    for _ in range(6000):  # 60 s of polls
        if _MEETING["arrived"] >= parties:
            return f"met {parties}"
        await asyncio.sleep(0.01)
    return "alone"


@pytest.fixture
def meeting():
    _MEETING["arrived"] = 0
    yield _MEETING
    _MEETING["arrived"] = 0


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"boom {x}")


def rows(n: int) -> list:
    """A structured result.

    Args:
        n: How many.
    """
    return [{"i": i} for i in range(n)]


def test_schema_equals_get_json_schema():
    (tool,) = build_tools([multiply])
    assert tool.schema == get_json_schema(multiply)
    assert tool.name == "multiply" and tool.function is multiply and not tool.is_async
    assert tool_schemas([tool, multiply, tool.schema]) == [get_json_schema(multiply)] * 3
    assert build_tools([slow_async])[0].is_async


def test_import_path_tools():
    tools = build_tools(["cohort.agents.builtins:calculator", "tests.unit.test_agents_tools:multiply"])
    assert [t.name for t in tools] == ["calculator", "multiply"]
    with pytest.raises(ConfigError, match="no attribute"):
        build_tools(["cohort.agents.builtins:nope"])
    with pytest.raises(ConfigError, match="import path"):
        build_tools(["not_a_path"])


@pytest.mark.parametrize("fn", [no_doc, no_hints])
def test_undocumented_or_unhinted_tool_is_a_config_error(fn):
    with pytest.raises(ConfigError) as info:
        build_tools([fn])
    msg = str(info.value)
    assert fn.__name__ in msg and "type hint" in msg and "docstring" in msg and "Args:" in msg


def test_duplicate_names_refused():
    def multiply(x: int) -> int:
        """Other.

        Args:
            x: x.
        """
        return x

    with pytest.raises(ConfigError, match="unique"):
        build_tools([globals()["multiply"], multiply])


def test_runner_results_in_order_and_values_as_text():
    runner = ToolRunner([multiply, rows])
    out = runner.run([ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("rows", {"n": 2}), ToolCall("multiply", {"a": 1})])
    assert out == [ToolResult("multiply", "12", False), ToolResult("rows", '[{"i": 0}, {"i": 1}]', False),
                   ToolResult("multiply", "2.0", False)]
    assert runner.run([]) == []


def test_async_tools_run_concurrently(meeting):
    runner = ToolRunner([meet_async], timeout_s=20)  # run one after the other, the first would wait out its timeout
    out = runner.run([ToolCall("meet_async", {"parties": 2}), ToolCall("meet_async", {"parties": 2})])
    assert [r.content for r in out] == ["met 2", "met 2"] and not any(r.failed for r in out)


def test_sync_tools_run_concurrently_too(meeting):
    runner = ToolRunner([meet_sync, meet_async], timeout_s=20)
    out = runner.run([ToolCall("meet_sync", {"parties": 3}), ToolCall("meet_sync", {"parties": 3}),
                      ToolCall("meet_async", {"parties": 3})])
    assert [r.content for r in out] == ["met 3"] * 3 and not any(r.failed for r in out)


def test_errors_become_messages_not_crashes():
    runner = ToolRunner([broken, multiply])
    out = runner.run([
        ToolCall("broken", {"x": 7}),
        ToolCall("nope", {}),
        ToolCall("multiply", {"c": 1}),
        ToolCall("multiply", {"a": 2}),
        ToolCall("__invalid__", {"raw": "{bad", "error": "not valid JSON"}),
    ])
    assert [r.failed for r in out] == [True, True, True, False, True]
    assert "RuntimeError" in out[0].content and "boom 7" in out[0].content
    assert "unknown tool 'nope'" in out[1].content and "multiply" in out[1].content
    assert "bad arguments" in out[2].content
    assert "could not parse" in out[4].content and "{bad" in out[4].content
    assert all(r.content.startswith("Error") for r in out if r.failed)


def test_hanging_tools_time_out():
    runner = ToolRunner([slow_sync, slow_async], timeout_s=0.2)
    out = runner.run([ToolCall("slow_sync", {"seconds": 30}), ToolCall("slow_async", {"seconds": 30}),
                      ToolCall("slow_async", {"seconds": 0.01})])
    assert [r.failed for r in out] == [True, True, False]  # 30 s sleeps answered with the timeout, not "slept 30"
    assert "timed out after 0.2 s" in out[0].content and "timed out after 0.2 s" in out[1].content


def test_run_inside_a_running_event_loop():
    runner = ToolRunner([multiply])

    async def main():
        return runner.run([ToolCall("multiply", {"a": 2, "b": 3})])

    assert asyncio.run(main())[0].content == "6"
    assert asyncio.run(runner.arun([ToolCall("multiply", {"a": 1, "b": 1})]))[0].content == "1"


def test_tool_calling_sys_exit_is_an_error_result():
    def quitter(code: int) -> int:
        """Exit.

        Args:
            code: Status.
        """
        raise SystemExit(code)

    (res,) = ToolRunner([quitter]).run([ToolCall("quitter", {"code": 3})])
    assert res.failed and "SystemExit" in res.content


def test_tool_objects_pass_through():
    tool = Tool.from_callable(multiply, name="times")
    assert tool.name == "times" and tool.schema["function"]["name"] == "times"
    assert ToolRunner([tool]).run([ToolCall("times", {"a": 2, "b": 2})])[0].content == "4"


def test_run_turns_runs_a_batch_at_once_and_keeps_rollouts_apart(meeting):
    from cohort.agents.tools import run_turns, tool_metrics

    a, b = ToolRunner([meet_sync, broken], timeout_s=20), ToolRunner([meet_async], timeout_s=20)
    turns = [(a, [ToolCall("meet_sync", {"parties": 2}), ToolCall("broken", {"x": 1})]), (b, []),
             (b, [ToolCall("meet_async", {"parties": 2}), ToolCall("meet_sync", {"parties": 2})])]
    out = run_turns(turns)  # the two rollouts' calls meet: they ran at once
    assert [[r.failed for r in rs] for rs in out] == [[False, True], [], [False, True]]  # b has no meet_sync
    assert out[0][0].content == "met 2" == out[2][0].content and "unknown tool" in out[2][1].content
    assert tool_metrics(out) == {"tools/call_frequency": 4 / 3, "tools/failure_frequency": 0.5}
    assert run_turns([(a, []), (b, [])]) == [[], []]
    assert tool_metrics([[], []]) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}


def test_string_arguments_are_cast_to_the_schema_type():
    out = ToolRunner([multiply]).run([ToolCall("multiply", {"a": "6", "b": "0.5"}), ToolCall("multiply", {"a": "six"})])
    assert out[0] == ToolResult("multiply", "3.0", False)
    assert out[1].failed and "RuntimeError" not in out[1].content  # "six" stays a string: the call itself fails


def test_serial_runner_keeps_call_order():
    seen = []

    def record(tag: str, wait: float) -> str:
        """Record a tag after waiting.

        Args:
            tag: The tag.
            wait: Seconds to wait first.
        """
        time.sleep(wait)
        seen.append(tag)
        return tag

    calls = [ToolCall("record", {"tag": "first", "wait": 0.2}), ToolCall("record", {"tag": "second", "wait": 0.0})]
    ToolRunner([record], serial=True).run(calls)
    assert seen == ["first", "second"]
    seen.clear()
    ToolRunner([record]).run(calls)
    assert seen == ["second", "first"]  # concurrent: the short call finishes first


def test_sync_calls_reuse_worker_threads():
    """Sync calls skip the event loop and run on reused daemon workers: many turns, few threads."""
    import threading

    runner = ToolRunner([multiply])
    runner.run([ToolCall("multiply", {"a": 2, "b": 3})])
    before = threading.active_count()
    for i in range(50):
        out = runner.run([ToolCall("multiply", {"a": i, "b": 2}), ToolCall("multiply", {"a": 1, "b": 1})])
        assert [r.content for r in out] == [str(2 * i), "1"] and not any(r.failed for r in out)
    assert threading.active_count() <= before + 2


def test_a_tool_returning_content_blocks_keeps_its_images_in_order():
    def screenshot() -> list:
        """Takes a screenshot."""
        return [{"type": "text", "text": "before"}, {"type": "image", "image": "IMG-A"},
                {"type": "image", "image": "IMG-B"}, {"type": "text", "text": "after"}]

    [result] = ToolRunner([Tool.from_callable(screenshot)]).run([ToolCall("screenshot", {})])
    assert not result.failed
    assert result.images == ("IMG-A", "IMG-B")
    assert result.parts == (("text", "before"), ("image", 0), ("image", 1), ("text", "after"))
    assert result.content == "before\nafter"
    # a plain list of dicts without images stays JSON text, as before
    def rows() -> list:
        """Rows."""
        return [{"type": "text", "text": "x"}]

    [plain] = ToolRunner([Tool.from_callable(rows)]).run([ToolCall("rows", {})])
    assert plain.images == () and plain.content == '[{"type": "text", "text": "x"}]'

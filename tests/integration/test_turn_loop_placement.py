"""agent.inline_tools=auto in the turn loop on the CPU engine: a quick tool runs on the engine's thread for the
whole run; a slow one runs there until 2 calls in a row took over 2 ms, then on the thread pool, where the
engine keeps stepping the other completions while it runs; and the rollouts are the same as with
inline_tools=True and False. Which thread ran a turn's calls is recorded by the runner; whether the engine moved
during a call, by the tool (it watches the engine's step counters). Nothing asserts a duration."""

from __future__ import annotations

import gc
import logging
import threading
import time

import pytest
from tests.helpers.tools import add
from tests.helpers.toy_task import tiny_model
from tests.integration.test_agent_rollouts import chat_tokenizer, prompts_for

from cohort.agents.rollout_loop import TurnLoop
from cohort.agents.tools import ToolCall, ToolResult, ToolRunner
from cohort.engine import CohortEngine
from cohort.types import SamplingParams

PARAMS = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=120, stop_token_ids=tuple(range(3, 60)))


class Recorder:
    """A ToolRunner that notes, per call, whether the engine's own (main) thread ran it (`inline`), and the same
    per `run` (`runs`: inline, the turns that ended in one engine step run their calls in one `run`)."""

    def __init__(self, tools):
        self.runner = ToolRunner(tools)
        self.inline: list[bool] = []
        self.runs: list[bool] = []

    def run(self, calls):
        main = threading.current_thread() is threading.main_thread()
        self.inline += [main] * len(calls)
        self.runs.append(main)
        return self.runner.run(calls)


def run_loop(tool, name, arguments, inline_tools="auto"):
    tok = chat_tokenizer()
    convs, ids = prompts_for(tok, n=4)
    engine = CohortEngine(tiny_model(tok, seed=2).eval(), tok, eos_token_ids=[tok.eos_token_id], block_size=8,
                          max_model_len=1024)
    recorder = Recorder([tool])
    loop = TurnLoop(tok, [tool], max_iterations=3, runner=recorder, inline_tools=inline_tools,
                    parser=lambda text, tokenizer=None: [ToolCall(name, arguments)])
    tool.engine = engine  # type: ignore[attr-defined]
    out = [c for g in loop.generate(engine, ids, PARAMS, prompts=convs) for c in g]
    loop.recorder = recorder  # type: ignore[attr-defined]
    return out, recorder.inline, loop


def nap(seconds: float) -> str:
    """Rest until the engine takes a step, or for at most `seconds`.

    Args:
        seconds: The longest rest.
    """
    stats = nap.engine.stats  # type: ignore[attr-defined]
    start = stats.decode_steps + stats.prefill_steps
    deadline = time.monotonic() + seconds
    while True:
        time.sleep(0.003)  # every call takes longer than the 2 ms under which a tool stays inline
        moved = stats.decode_steps + stats.prefill_steps > start
        if moved or time.monotonic() > deadline:
            nap.moved.append(moved)  # type: ignore[attr-defined]
            return "rested"


def test_auto_keeps_a_quick_tool_on_the_engine_thread():
    out, inline, loop = run_loop(add, "add", {"a": 2, "b": 3})
    assert len(inline) > 4 and all(inline)
    assert loop.placement.modes["add"][0] == "inline"
    assert sum(c.tool_calls for c in out) == len(inline)
    # the turns that end in one engine step run their calls together (TurnLoop's on_turn_end.many)
    assert len(loop.recorder.runs) < len(inline)  # type: ignore[attr-defined]


def test_auto_moves_a_slow_tool_to_the_pool_where_generation_goes_on(caplog):
    nap.moved = []  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="cohort.agents"):
        out, inline, loop = run_loop(nap, "nap", {"seconds": 0.04})
    moved = nap.moved  # type: ignore[attr-defined]
    # inline for its first 2 turns (2 in a row over 2 ms; 1 on a machine so loaded that it took over 50 ms), and
    # the other turns that ended in the same engine steps (their calls run together, in one `run`)
    first = inline.count(True)
    runs = loop.recorder.runs  # type: ignore[attr-defined]
    assert 1 <= runs.count(True) <= 2 and runs == [True] * runs.count(True) + [False] * (len(runs) - runs.count(True))
    assert len(inline) > 4 and inline == [True] * first + [False] * (len(inline) - first) and first < len(inline)
    assert loop.placement.modes["nap"][0] == "pool"
    assert "'nap' now runs on the thread pool" in caplog.text
    # inline, the engine waits for the call: it cannot step; on the pool it steps the other completions
    assert not any(moved[:first]) and any(moved[first:])
    # the same rollouts as with every call inline, and every call on the pool
    for inline_tools in (True, False):
        nap.moved = []  # type: ignore[attr-defined]
        other, _, _ = run_loop(nap, "nap", {"seconds": 0.04}, inline_tools=inline_tools)
        for a, b in zip(out, other, strict=True):
            assert (a.token_ids, a.mask, a.turns) == (b.token_ids, b.mask, b.turns)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)  # other batches: float rounding only
            assert (a.tool_calls, a.tool_failures, a.messages) == (b.tool_calls, b.tool_failures, b.messages)


class PausingRunner(Recorder):
    """Each turn stands in for a full garbage collection landing inside a quick call: the collector's callbacks
    fire around a 60 ms wait, and the call reports those 60 ms as its own duration."""

    def run(self, calls):
        self.inline.append(threading.current_thread() is threading.main_thread())
        self.runs.append(self.inline[-1])
        for callback in list(gc.callbacks):
            callback("start", {"generation": 2})
        time.sleep(0.06)
        for callback in list(gc.callbacks):
            callback("stop", {"generation": 2})
        return [ToolResult(c.name, "5", seconds=0.06) for c in calls]


def test_auto_does_not_blame_a_tool_for_the_garbage_collectors_pauses():
    tok = chat_tokenizer()
    convs, ids = prompts_for(tok, n=2)
    engine = CohortEngine(tiny_model(tok, seed=2).eval(), tok, eos_token_ids=[tok.eos_token_id], block_size=8,
                          max_model_len=1024)
    runner = PausingRunner([add])
    loop = TurnLoop(tok, [add], max_iterations=2, runner=runner,
                    parser=lambda text, tokenizer=None: [ToolCall("add", {"a": 2, "b": 3})])
    loop.generate(engine, ids, PARAMS, prompts=convs)
    assert len(runner.inline) > 2 and all(runner.inline) and loop.placement.modes["add"][0] == "inline"

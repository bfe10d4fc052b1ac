"""Multi-turn decode keeps the device busy while the host handles turn ends (engine/launches.py).

When turns end in a multi-step launch, the next decode launch is queued before the turn-end callbacks run
(parsing, tools, rendering), and continued turns that the scheduler defers do not stop launches from chaining.
Both only change when work is queued: tokens, logprobs and masks equal one decode step per iteration.
Tiny float32 models on the CPU, where the K-step loop runs eagerly (the code a CUDA graph captures on a GPU).
"""

from __future__ import annotations

from tests.integration.engine_models import random_prompts, tiny_model
from tests.integration.test_engine_multi_step import assert_same, make_engine, spy_launches
from tests.integration.test_engine_turns import STOPS, scripted

from cohort.types import SamplingParams, TurnEnd


def _params():
    return SamplingParams(n=4, temperature=1.0, max_tokens=60, seed=3, stop_token_ids=STOPS)


def test_turn_end_callbacks_run_while_the_next_launch_decodes():
    """Every callback that runs while other conversations still decode (and no prefill is due) finds the next
    decode launch already queued."""
    model = tiny_model("qwen3")
    prompts = random_prompts([5, 9, 7, 6])
    ref = make_engine(model, 1).generate_turns(prompts, _params(), scripted)
    engine = make_engine(model, 4)
    seen: list[bool] = []  # per callback with decodable work: was a launch (or a scheduled decode) queued?

    def callback(turn: TurnEnd):
        scheduler = engine.scheduler
        if scheduler.running and (not scheduler.waiting or scheduler.defers_continuations()):
            seen.append(engine._inflight is not None or engine._scheduled is not None)
        return scripted(turn)

    got = engine.generate_turns(prompts, _params(), callback)
    assert_same(got, ref)
    assert len(seen) >= 5 and all(seen), seen
    assert engine._inflight is None and engine._scheduled is None and engine.blocks.num_used_blocks == 0


def test_launches_chain_while_continued_turns_are_deferred():
    """A continued turn waits up to continuation_delay_steps decode steps for others to join its prefill;
    meanwhile the decoding rows' launches chain (the deferral counts their steps) instead of each waiting for
    the host."""
    model = tiny_model("qwen3")
    prompts = random_prompts([5, 9, 7, 6])
    ref = make_engine(model, 1).generate_turns(prompts, _params(), scripted)
    engine = make_engine(model, 4, continuation_delay_steps=8)
    launches = spy_launches(engine)
    waiting_at_chain: list[bool] = []
    launch = engine.runner.launch_multi

    def spy(seqs, budgets, chained=False):
        if chained:
            waiting_at_chain.append(bool(engine.scheduler.waiting))
        return launch(seqs, budgets, chained)

    engine.runner.launch_multi = spy
    got = engine.generate_turns(prompts, _params(), scripted)
    assert_same(got, ref)
    assert any(c for _, c in launches)
    assert any(waiting_at_chain), "no launch chained while a continued turn waited"
    assert engine.scheduler.deferred_steps <= 8 and engine.blocks.num_used_blocks == 0

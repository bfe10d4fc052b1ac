"""serving/coalesce.py: concurrent requests run as one batch, each gets exactly the completions it would get
alone (seeds follow the request's own numbering), an error reaches every caller of its batch, and a caller
is answered as soon as its own batch is done (the lead passes on)."""

from __future__ import annotations

import functools
import threading

import pytest
from tests.helpers.threads import run_at_once

from cohort.serving.coalesce import Coalescer
from cohort.types import Completion, SamplingParams


def engine_like(prompts, params):
    """Draws as the engine does: completion j of prompt m of the call with seed + m * n + j."""
    return [[Completion([hash((tuple(prompt), p.seed + m * p.n + j)) % 1000], [0.0], "stop") for j in range(p.n)]
            for m, (prompt, p) in enumerate(zip(prompts, params, strict=True))]


REQUESTS = [([[1, 2], [3]], SamplingParams(n=2, seed=10)), ([[4]], SamplingParams(n=3, seed=7)),
            ([[5, 6], [7], [8]], [SamplingParams(n=1, seed=1), SamplingParams(n=2, seed=2), SamplingParams(n=1, seed=3)])]


def _alone(prompts, params):
    per = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    return engine_like(prompts, per)


def test_concurrent_requests_share_a_batch_and_draw_as_alone():
    calls = []

    def generate(prompts, params):
        calls.append(len(prompts))
        return engine_like(prompts, params)

    co = Coalescer(generate, window_s=0.2)  # long enough for the three threads to queue
    results = run_at_once([functools.partial(co.run, *request) for request in REQUESTS], timeout_s=10)
    assert calls == [6]  # one merged batch of all six prompts
    for k, (prompts, params) in enumerate(REQUESTS):
        assert [[c.token_ids for c in g] for g in results[k]] == [[c.token_ids for c in g] for g in _alone(prompts, params)]


def test_an_error_reaches_every_caller_of_its_batch():
    def generate(prompts, params):
        raise RuntimeError("engine failed")

    co = Coalescer(generate, window_s=0.1)
    outcomes = run_at_once([functools.partial(co.run, *REQUESTS[k]) for k in range(2)], timeout_s=10)
    errors = [str(exc) for exc in outcomes if isinstance(exc, RuntimeError)]
    assert errors == ["engine failed", "engine failed"]
    assert co._running is False  # the next request leads again
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        co.run([[1]], [SamplingParams(), SamplingParams()])


def test_a_caller_is_answered_when_its_own_batch_is_done():
    """The first request's batch is done while a later one (queued during it) still runs: the first caller
    returns without waiting for it, and the lead passes to the queued request."""
    first_running, release_second, answered = threading.Event(), threading.Event(), threading.Event()

    def generate(prompts, params):
        if prompts == [[9]]:  # the second batch: held until the first caller has its answer
            assert release_second.wait(10)
        else:
            first_running.set()
            answered.wait(0.5)  # let the second request queue during this batch
        return engine_like(prompts, params)

    co = Coalescer(generate, window_s=0.0)
    out = {}
    first = threading.Thread(target=lambda: (out.__setitem__("first", co.run([[1]], SamplingParams(seed=1))),
                                             answered.set()))
    first.start()
    assert first_running.wait(10)
    second = threading.Thread(target=lambda: out.__setitem__("second", co.run([[9]], SamplingParams(seed=2))))
    second.start()
    assert answered.wait(10)  # the first caller returned while the second batch is held
    release_second.set()
    second.join(10)
    first.join(10)
    assert co.batches == 2 and set(out) == {"first", "second"}

"""Continued turns prefilled as one decode-shaped forward (engine/continuation_graphs.py) equal the general path.

Each new token of a continued turn becomes a decode row whose context is its sequence's paged KV up to its own
position. On the CPU the decode attention is the gather path and no graph is captured (the path is built by hand
here: on a GPU it is the default, with the Triton kernel and CUDA graphs, tests/gpu/test_engine_turns_gpu.py);
tokens, logprobs and masks must equal the general prefill's (varlen / SDPA, then the prefix attention redone), and
the decode-shaped forward must actually have served every continued turn.
"""

from __future__ import annotations

import pytest
from tests.integration.engine_models import random_prompts, tiny_model
from tests.integration.test_engine_multi_step import assert_same
from tests.integration.test_engine_turns import STOPS, expected_mask, make_engine, scripted

from cohort.engine.continuation_graphs import ContinuationPrefill
from cohort.engine.sequence import PrefillUnit
from cohort.types import SamplingParams


def _params(n: int = 3):
    return SamplingParams(n=n, temperature=1.0, max_tokens=60, seed=11, stop_token_ids=STOPS)


def _with_decode_shaped_continuations(engine, max_tokens: int = 2048) -> ContinuationPrefill:
    assert engine.runner.continuations is None  # CPU: no Triton decode kernel, the general path by default
    engine.runner.continuations = ContinuationPrefill(engine.runner, max_tokens, graphs=False)
    return engine.runner.continuations


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma3"])  # mistral, gemma3: sliding windows
def test_decode_shaped_continuations_equal_the_general_prefill(family):
    model = tiny_model(family)
    prompts = random_prompts([5, 9, 7, 6, 12])
    ref = make_engine(model).generate_turns(prompts, _params(), scripted)
    engine = make_engine(model)
    path = _with_decode_shaped_continuations(engine)
    got = engine.generate_turns(prompts, _params(), scripted)
    assert_same(got, ref)
    assert path.eager_runs >= 2, "no continued turn went through the decode-shaped forward"
    assert any(c.turns > 1 for g in got for c in g)
    for group in got:
        for completion in group:
            assert completion.mask == expected_mask(completion)
    assert engine.blocks.num_used_blocks == 0


def test_steps_over_the_token_cap_take_the_general_path():
    model = tiny_model("llama")
    prompts = random_prompts([5, 9, 7, 6])
    ref = make_engine(model).generate_turns(prompts, _params(), scripted)
    engine = make_engine(model)
    path = _with_decode_shaped_continuations(engine, max_tokens=2)  # every continued turn appends 3+ tokens
    assert_same(engine.generate_turns(prompts, _params(), scripted), ref)
    assert path.eager_runs == 0


def test_fresh_prompts_take_the_general_path():
    engine = make_engine(tiny_model("llama"))
    assert engine.config.continuation_delay_steps == 8  # no continuation graphs here: turns wait to share a prefill
    path = _with_decode_shaped_continuations(engine)
    out = engine.generate(random_prompts([5, 9]), SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1))
    assert len(out) == 2 and path.eager_runs == 0
    assert path.maybe_run([PrefillUnit([engine._add(0, [1, 2, 3], _params(1))[0]])]) is None
    engine._abort()

"""Continued turns through the decode-shaped CUDA graphs (engine/continuation_graphs.py) against the general
prefill path on the GPU (skips without CUDA).

The two compute the same attention with different kernels (the paged decode kernel against varlen + padded SDPA)
in bf16, so logprobs agree to bf16 rounding and sampled tokens (noise from seed and position only) agree but for
rare near-ties; the graphs must have served the continued turns, and a recapture (moved KV pool or weights) drops them.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.integration.engine_models import EOS, random_prompts, tiny_model
from tests.integration.test_engine_turns import STOPS, scripted

from cohort.engine import CohortEngine
from cohort.types import SamplingParams

pytestmark = pytest.mark.gpu


def _engine(model, tokens: int) -> CohortEngine:
    return CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=512, max_num_seqs=64,
                        continuation_graph_tokens=tokens)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])
def test_continuation_graphs_equal_the_general_prefill(family):
    model = tiny_model(family).cuda().to(torch.bfloat16)
    prompts = random_prompts([40, 90, 17, 64, 33, 120], seed=2)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=80, seed=7, stop_token_ids=STOPS)
    graphs, general = _engine(model, 2048), _engine(model, 0)
    assert graphs.runner.continuations is not None and general.runner.continuations is None
    # continued turns join at once where their prefill is a graph replay; they wait to share one elsewhere
    assert graphs.config.continuation_delay_steps == 0 and general.config.continuation_delay_steps == 8
    ref = general.generate_turns(prompts, params, scripted)
    got = graphs.generate_turns(prompts, params, scripted)
    path = graphs.runner.continuations
    assert path.captures >= 1 and path.replays >= 2
    pairs = [(a, b) for ga, gb in zip(got, ref) for a, b in zip(ga, gb)]
    same = [a.token_ids == b.token_ids for a, b in pairs]
    assert sum(same) >= 0.8 * len(pairs), f"{sum(same)} of {len(pairs)} completions equal"
    assert any(a.turns > 1 for a, _ in pairs)
    for a, b in pairs:
        if a.token_ids == b.token_ids:
            assert a.mask == b.mask
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 0.1
    graphs.runner.graphs.clear()
    graphs.runner._capture_graphs()  # a moved KV pool or moved weights: the continuation graphs go too
    assert not path.graphs
    again = graphs.generate_turns(prompts, params, scripted)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in got]


def test_the_engine_freezes_what_exists_when_it_is_built():
    """On a GPU the engine moves the objects alive at its construction (model, tokenizer, graphs) out of the
    collector's reach (gc.freeze), so a full collection in a generate call does not walk them."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    _engine(tiny_model("llama").cuda().to(torch.bfloat16), 2048)
    assert gc.get_freeze_count() > 1000

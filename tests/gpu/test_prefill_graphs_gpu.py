"""Prefill CUDA graphs (engine/prefill_graphs.py) against the eager prefill on the GPU (skips without CUDA).

The graph pads the packed tokens to a multiple of 512 and the sequence slots to a power of two, so cuBLAS may
pick other tiles for the padded shapes: the first tokens' logprobs agree to bf16 rounding, and a sampled
generation (the noise depends on seed and position only) gives the same tokens.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.integration.engine_models import EOS, random_prompts, tiny_model

from cohort.engine import CohortEngine
from cohort.types import SamplingParams

pytestmark = pytest.mark.gpu


def _engine(model, graph_tokens: int) -> CohortEngine:
    return CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=1024, max_num_seqs=16,
                        prefill_graph_tokens=graph_tokens)


def _first_logprobs(engine, prompts):
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    return [g[0].token_ids[0] for g in out], torch.tensor([g[0].logprobs[0] for g in out])


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_prefill_graph_equals_eager_prefill(family):
    model = tiny_model(family).cuda().to(torch.bfloat16)
    graphs, eager = _engine(model, 4096), _engine(model, 0)
    assert graphs.runner.prefill_graphs is not None and eager.runner.prefill_graphs is None
    exact = random_prompts([128, 128, 128, 128])  # 512 tokens: no padding tokens, 4 sequences in 8 slots
    tok_g, lp_g = _first_logprobs(graphs, exact)
    tok_e, lp_e = _first_logprobs(eager, exact)
    assert tok_g == tok_e and (lp_g - lp_e).abs().max() < 1e-2
    assert graphs.runner.prefill_graphs.captures == 1
    ragged = random_prompts([5, 300, 17, 80, 1], seed=3)  # 403 tokens padded to 512, 5 sequences in 8 slots
    tok_g, lp_g = _first_logprobs(graphs, ragged)
    tok_e, lp_e = _first_logprobs(eager, ragged)
    assert (lp_g - lp_e).abs().max() < 2e-2
    assert sum(a == b for a, b in zip(tok_g, tok_e)) >= 4
    _first_logprobs(graphs, exact)  # a shape seen before replays without capturing
    assert graphs.runner.prefill_graphs.captures == 2 and graphs.runner.prefill_graphs.replays == 3


def test_generation_with_prefill_graphs_equals_eager_and_survives_recapture():
    model = tiny_model("qwen2").cuda().to(torch.bfloat16)
    prompts = random_prompts([100, 156, 200, 56])  # 512 tokens
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=5)
    graphs, eager = _engine(model, 4096), _engine(model, 0)
    ref = [[c.token_ids for c in g] for g in eager.generate(prompts, params)]
    assert [[c.token_ids for c in g] for g in graphs.generate(prompts, params)] == ref
    graphs.runner.graphs.clear()
    graphs.runner._capture_graphs()  # what a moved KV pool or moved weights trigger: prefill graphs go too
    assert not graphs.runner.prefill_graphs.graphs
    assert [[c.token_ids for c in g] for g in graphs.generate(prompts, params)] == ref


def test_large_prefills_stay_eager():
    model = tiny_model("qwen2").cuda().to(torch.bfloat16)
    engine = _engine(model, 512)
    engine.generate(random_prompts([400, 400]), SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.runner.prefill_graphs.captures == 0

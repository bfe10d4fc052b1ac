"""The fused RoPE + K/V-cache-write kernel (triton_rope.rope_store_kv) on the GPU: bit-equal to eager
`layers.rope` + `store_kv`, replayable from a CUDA graph, and the engine's greedy tokens with it equal to
the unfused path's (COHORT_FUSED_ROPE_KV=0) and HF's. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")

from tests.integration.engine_models import EOS, hf_greedy, random_prompts, recomputed_logprobs, tiny_model

from cohort.engine import CohortEngine
from cohort.engine.attention import store_kv
from cohort.engine.models.layers import rope
from cohort.engine.triton_rope import ENV_SWITCH, rope_store_kv
from cohort.types import SamplingParams

pytestmark = pytest.mark.gpu


def _case(tokens, heads, kv_heads, dim, dtype, block=16, blocks=64):
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda").to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    angles = torch.rand(tokens, dim // 2, device="cuda") * 100
    angles = torch.cat([angles, angles], dim=-1)
    k_cache = torch.randn(blocks, block, kv_heads, dim, device="cuda").to(dtype)
    slots = torch.randperm(blocks * block, device="cuda")[:tokens]
    return (q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim),
            angles.cos().to(dtype), angles.sin().to(dtype), k_cache, torch.randn_like(k_cache), slots)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"),
                         [(256, 14, 2, 64), (1, 14, 2, 64), (300, 16, 8, 128), (33, 4, 1, 256), (7, 28, 4, 128)])
def test_matches_eager_rope_and_store_kv_exactly(dtype, tokens, heads, kv_heads, dim):
    torch.manual_seed(0)
    q, k, v, cos, sin, kc, vc, slots = _case(tokens, heads, kv_heads, dim, dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref_q, ref_k = rope(q, k, cos, sin)  # eager: HF's rounding in the model dtype
    store_kv(ref_kc, ref_vc, ref_k, v, slots)
    got_q, got_k = rope_store_kv(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


def test_replays_from_a_cuda_graph():
    """Captured once, replayed with new inputs and slots: reads everything from the device."""
    torch.manual_seed(0)
    q, k, v, cos, sin, kc, vc, slots = _case(64, 14, 2, 64, torch.bfloat16)
    inputs = [x.clone() for x in (q, k, v, cos, sin, slots)]
    graph = torch.cuda.CUDAGraph()
    rope_store_kv(*inputs[:5], kc, vc, inputs[5])  # compile outside the capture
    with torch.cuda.graph(graph):
        rope_store_kv(*inputs[:5], kc, vc, inputs[5])
    q2, k2, v2, cos2, sin2, _, _, slots2 = _case(64, 14, 2, 64, torch.bfloat16)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref_q, ref_k = rope(q2, k2, cos2, sin2)
    store_kv(ref_kc, ref_vc, ref_k, v2, slots2)
    for buf, new in zip(inputs, (q2, k2, v2, cos2, sin2, slots2)):
        buf.copy_(new)
    graph.replay()
    assert torch.equal(inputs[0], ref_q) and torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe"])
def test_graphs_greedy_fused_equals_unfused_and_hf_float32(monkeypatch, family):
    model = tiny_model(family).cuda()
    prompts = random_prompts([5, 11, 2, 17, 8])
    params = SamplingParams(temperature=0.0, max_tokens=20)
    tokens = {}
    for fused in (True, False):
        monkeypatch.setenv(ENV_SWITCH, "1" if fused else "0")
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16)
        assert engine.runner.net.fused_rope_kv == fused
        assert bool(engine.runner.graphs) == (family != "qwen3_moe")  # the MoE's float32 loop is not graph-safe
        tokens[fused] = [g[0].token_ids for g in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
    assert tokens[True] == hf_greedy(model, prompts, 20)


def test_bf16_sampled_logprobs_close_to_recompute_with_fused_kernel():
    model = tiny_model("qwen2").to("cuda", torch.bfloat16)
    prompts = random_prompts([4, 30])
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16)
    assert engine.runner.net.fused_rope_kv and engine.runner.graphs
    out = engine.generate(prompts, SamplingParams(n=4, temperature=0.8, max_tokens=20, seed=1))
    for prompt, group in zip(prompts, out):
        for c in group:
            ref = recomputed_logprobs(model, prompt, c.token_ids, 0.8)
            assert c.logprobs == pytest.approx(ref, abs=0.1)

"""The engine families beyond dense Llama/Qwen on the GPU: windowed Triton decode and varlen prefill against the
PyTorch references, CUDA-graph greedy of tiny Mistral / Gemma 3 / Qwen3-MoE against HF in float32, the
grouped-matmul MoE path in bf16 against the per-expert loop, and the packed forward with windows in bf16.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")

from tests.integration.engine_models import (
    EOS,
    VOCAB,
    hf_greedy,
    random_prompts,
    recomputed_logprobs,
    tiny_model,
)

from cohort.engine import CohortEngine, triton_ops
from cohort.engine.attention import AttnContext, decode_gather, prefill_sdpa, prefill_varlen
from cohort.types import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [1, 5, 64, 100, 300])
def test_windowed_paged_decode_kernel_matches_gather(window):
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block, blocks = 9, 8, 2, 64, 64, 40
    q = torch.randn(batch, heads, dim, device="cuda")
    kc = torch.randn(blocks, block, kv_heads, dim, device="cuda")
    vc = torch.randn_like(kc)
    tables = torch.randint(0, blocks, (batch, 8), device="cuda", dtype=torch.int32)
    ctx_lens = torch.randint(1, 8 * block, (batch,), device="cuda", dtype=torch.int32)
    out = triton_ops.paged_decode_attention(q, kc, vc, tables, ctx_lens, 0.125, window)
    ctx = AttnContext(False, None, block_tables=tables, ctx_lens=ctx_lens, max_ctx_len=8 * block)
    ref = decode_gather(q, kc, vc, ctx, 0.125, window)
    assert (out - ref).norm() / ref.norm() < 1e-5
    full = decode_gather(q, kc, vc, ctx, 0.125)
    if window < 100:
        assert (full - ref).norm() / ref.norm() > 1e-3  # the window changed the result


def test_windowed_varlen_prefill_matches_sdpa():
    torch.manual_seed(0)
    cu = [0, 5, 130, 131, 400]
    q = torch.randn(400, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(400, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ctx = AttnContext(True, None, cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.int32),
                      cu_seqlens_host=cu, max_seqlen=269)
    out = prefill_varlen(q, k, v, ctx, 0.125, window=32).float()
    ref = prefill_sdpa(q.float(), k.float(), v.float(), ctx, 0.125, window=32)
    assert (out - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("family", ["mistral", "qwen2_sliding", "gemma3", "qwen3_moe"])
def test_graphs_greedy_matches_hf_float32(family):
    model = tiny_model(family).cuda()
    prompts = random_prompts([5, 11, 2, 17, 8, 25], seed=2)
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16)
    # float32 MoE takes the per-expert loop (host-side counts), so it runs without graphs
    assert bool(engine.runner.graphs) == (family != "qwen3_moe")
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    assert [g[0].token_ids for g in out] == hf_greedy(model, prompts, 20)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_bf16_sampled_logprobs_close_to_recompute(family):
    model = tiny_model(family).cuda().to(torch.bfloat16)
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16)
    if family == "qwen3_moe":
        assert engine.runner.net.grouped and engine.runner.graphs  # grouped_mm experts inside CUDA graphs
    prompts = random_prompts([4, 13], seed=3)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=15, seed=0, ignore_eos=True))
    for prompt, group in zip(prompts, out):
        for completion in group:
            ref = recomputed_logprobs(model, prompt, completion.token_ids, 1.0)
            diff = torch.tensor(completion.logprobs) - torch.tensor(ref)
            assert diff.abs().mean() < 0.05, diff


def test_moe_grouped_bf16_matches_loop():
    from cohort.engine.models.qwen3_moe import moe_experts, route

    torch.manual_seed(0)
    experts, hidden, inter, tokens = 8, 64, 32, 300
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") * 0.1).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda") * 0.1).bfloat16()
    h = torch.randn(tokens, hidden, device="cuda").bfloat16()
    weights, ids = route(h, torch.randn(experts, hidden, device="cuda").bfloat16(), 2, True)
    silu = torch.nn.functional.silu
    grouped = moe_experts(h, weights, ids, gate_up, down, silu, grouped=True).float()
    loop = moe_experts(h, weights, ids, gate_up, down, silu, grouped=False).float()
    assert (grouped - loop).norm() / loop.norm() < 2e-2


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen3_moe"])
def test_packed_bf16_close_to_unpacked(family):
    from cohort.forward.packed_attention import disable_packed_attention
    from cohort.forward.packing import packed_forward_logprobs

    model = tiny_model(family).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    seqs = [(torch.randint(3, VOCAB, (p,), generator=g).tolist(), torch.randint(3, VOCAB, (c,), generator=g).tolist())
            for p, c in [(5, 7), (16, 9), (30, 20)]]
    with torch.no_grad():
        packed = packed_forward_logprobs(model, seqs, attn="varlen")
    disable_packed_attention(model)
    for (prompt, completion), (lp, _) in zip(seqs, packed.split()):
        ref = torch.tensor(recomputed_logprobs(model, prompt, completion, 1.0), device="cuda")
        assert (lp - ref).abs().mean() < 0.05

"""CohortEngine's GPU path: Triton kernels against the PyTorch references, CUDA graphs against eager and HF."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")

from tests.integration.engine_models import EOS, hf_greedy, random_prompts, recomputed_logprobs, tiny_model

from cohort.engine import (
    CohortEngine,
    triton_ops,
)
from cohort.engine.attention import AttnContext, decode_gather, prefill_sdpa, prefill_varlen
from cohort.engine.sampler import gumbel_noise, row_keys
from cohort.types import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("splits", [1, 4, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(14, 64), (12, 128)])  # Qwen2.5-0.5B's and 1.5B's (heads, head size)
def test_paged_decode_kernel_matches_gather(dtype, splits, shape):
    torch.manual_seed(0)
    (heads, dim), kv_heads, batch, block, blocks = shape, 2, 9, 64, 40
    q = torch.randn(batch, heads, dim, device="cuda", dtype=dtype)
    kc = torch.randn(blocks, block, kv_heads, dim, device="cuda", dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.randint(0, blocks, (batch, 8), device="cuda", dtype=torch.int32)
    ctx_lens = torch.randint(1, 8 * block, (batch,), device="cuda", dtype=torch.int32)
    out = triton_ops.paged_decode_attention(q, kc, vc, tables, ctx_lens, 0.125, splits=splits)
    ctx = AttnContext(False, None, block_tables=tables, ctx_lens=ctx_lens, max_ctx_len=8 * block)
    ref = decode_gather(q.float(), kc.float(), vc.float(), ctx, 0.125)
    err = (out.float() - ref).norm() / ref.norm()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def _sampler_rows(method: str):
    """64 rows of Qwen's vocabulary, mixed temperatures, a third greedy, sampled by `method`: (logits, 1/T,
    noise, row keys, tokens, logprobs)."""
    torch.manual_seed(0)
    logits = (torch.randn(64, 151936, device="cuda") * 4).to(torch.bfloat16)
    seeds = torch.randint(0, 2**62, (64,))
    positions = torch.randint(0, 5000, (64,))
    keys = torch.from_numpy(row_keys(seeds.numpy(), positions.numpy())).cuda()
    inv_t = torch.rand(64, device="cuda") + 0.5
    noise = (torch.rand(64, device="cuda") > 0.3).float()
    tokens, logprobs = triton_ops.fused_sample(logits, logits, inv_t, noise, seeds.cuda(), positions.cuda(),
                                               method=method)
    return logits, inv_t, noise, keys, tokens, logprobs


def test_fused_sampler_matches_torch():
    logits, inv_t, noise, keys, tokens, logprobs = _sampler_rows("gumbel")
    scaled = logits.float() * inv_t[:, None]
    ref_tokens = (scaled + noise[:, None] * gumbel_noise(keys, logits.shape[1])).argmax(-1)
    ref_lp = scaled.gather(-1, ref_tokens[:, None])[:, 0] - scaled.logsumexp(-1)
    assert (tokens == ref_tokens).float().mean() > 0.98  # float ties aside, the same draws
    same = tokens == ref_tokens
    assert torch.allclose(logprobs[same], ref_lp[same], atol=1e-4)


def test_cdf_sampler_matches_its_reference():
    """The inverse-CDF pass (triton_cdf) on the GPU against its float64 reference, Qwen's vocabulary."""
    from cohort.engine.triton_cdf import cdf_sample_reference

    logits, inv_t, noise, keys, tokens, logprobs = _sampler_rows("cdf")
    ref_tokens, ref_lp = cdf_sample_reference(logits, inv_t, noise, keys)
    same = tokens == ref_tokens
    assert same.float().mean() > 0.95 and same[noise == 0].all()  # float rounding at a CDF boundary aside
    assert torch.allclose(logprobs[same], ref_lp[same], atol=1e-4)


def test_varlen_prefill_matches_sdpa():
    torch.manual_seed(0)
    cu = [0, 5, 130, 131, 400]
    q = torch.randn(400, 14, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(400, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ctx = AttnContext(True, None, cu_seqlens=torch.tensor(cu, device="cuda", dtype=torch.int32),
                      cu_seqlens_host=cu, max_seqlen=269)
    out = prefill_varlen(q, k, v, ctx, 0.125).float()
    ref = prefill_sdpa(q.float(), k.float(), v.float(), ctx, 0.125)
    assert (out - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize(("family", "fuse"), [("llama", None), ("qwen2", None), ("qwen3", None), ("qwen2", False)])
def test_graphs_greedy_matches_hf_float32(family, fuse):
    model = tiny_model(family).cuda()
    prompts = random_prompts([5, 11, 2, 17, 8])
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16,
                          fuse_projections=fuse)
    assert bool(engine.runner.net.fused) == (fuse is None)
    assert engine.runner.graphs, "CUDA graphs were not captured"
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    assert [g[0].token_ids for g in out] == hf_greedy(model, prompts, 20)


def test_graph_sampled_logprobs_match_recompute_float32():
    model = tiny_model("qwen2").cuda()
    prompts = random_prompts([4, 30])
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16)
    out = engine.generate(prompts, SamplingParams(n=4, temperature=0.8, max_tokens=20, seed=1))
    for prompt, group in zip(prompts, out):
        for c in group:
            ref = recomputed_logprobs(model, prompt, c.token_ids, 0.8)
            assert c.logprobs == pytest.approx(ref, abs=1e-4)


def test_released_kv_pool_keeps_cuda_graphs_valid():
    """After release and a training-sized allocation in between, generate gives the same tokens: either the
    pool came back at its address (graphs valid) or the graphs were recaptured."""
    model = tiny_model("qwen2").cuda()
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=16)
    prompts = random_prompts([37, 15])
    params = SamplingParams(n=4, max_tokens=24, seed=3, ignore_eos=True)
    first = engine.generate(prompts, params)
    engine.release_kv_cache()
    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the update's activations, say
    del scratch
    again = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert engine.runner.graph_recaptures in (0, 1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_multi_turn_on_graphs_matches_hf_reference_float32(family):
    """Continued turns on CUDA: prefix prefill (gather + SDPA) then graph-replayed decode on the kept blocks."""
    from tests.integration.test_engine_turns import CONTEXT, STOPS, _Tok, scripted

    from cohort.engine.hf_backend import HFGenerateEngine

    model = tiny_model(family).cuda()
    prompts = random_prompts([7, 12, 5, 20])
    params = SamplingParams(n=1, temperature=0.0, max_tokens=80, stop_token_ids=STOPS)
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=160, max_num_seqs=16)
    assert engine.runner.graphs
    got = engine.generate_turns(prompts, params, scripted)
    ref = HFGenerateEngine(model, _Tok(), eos_token_ids=[EOS]).generate_turns(prompts, params, scripted)
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in ref]
    assert [g[0].mask for g in got] == [g[0].mask for g in ref]
    continued = len(prompts) * (len(CONTEXT[1]) + 1 + len(CONTEXT[2]) + 1)
    assert engine.stats.prefill_tokens == sum(map(len, prompts)) + continued


def test_multi_turn_sampled_logprobs_match_recompute_bf16_and_float32():
    from tests.integration.test_engine_turns import STOPS, scripted

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        model = tiny_model("qwen2").to("cuda", dtype)
        prompts = random_prompts([4, 30])
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=160, max_num_seqs=16)
        out = engine.generate_turns(prompts, SamplingParams(n=4, temperature=0.8, max_tokens=60, seed=1,
                                                            stop_token_ids=STOPS), scripted)
        for prompt, group in zip(prompts, out):
            for c in group:
                ref = recomputed_logprobs(model, prompt, c.token_ids, 0.8)
                got = [(a, b) for a, b, m in zip(c.logprobs, ref, c.mask) if m]
                assert [a for a, _ in got] == pytest.approx([b for _, b in got], abs=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_step_graphs_equal_one_step_graphs(dtype):
    """decode_steps=8 (one graph of 8 forwards, tokens fed back on the device) samples exactly the tokens of
    one step per replay, with rows stopping (EOS, max_tokens) inside a chunk and a batch padded to a graph
    size; the default on CUDA is 8."""
    model = tiny_model("qwen2").to("cuda", dtype)
    prompts = random_prompts([5, 30, 2, 17, 8, 21, 3])
    params = [SamplingParams(n=3, temperature=t, max_tokens=m, seed=9 + i)
              for i, (t, m) in enumerate(zip([1.0, 0.0, 1.0, 0.7, 1.0, 0.0, 1.0], [13, 40, 1, 22, 6, 31, 17]))]
    outs = {}
    for steps in (1, None):
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=32,
                              decode_steps=steps)
        assert engine.runner.decode_steps == (steps or 8)
        assert bool(engine.runner.multi_graphs) == (steps is None)
        outs[steps] = engine.generate(prompts, params)
        assert engine.blocks.num_used_blocks == 0 and engine._inflight is None
    for g1, g8 in zip(outs[1], outs[None]):
        for c1, c8 in zip(g1, g8):
            assert c8.token_ids == c1.token_ids and c8.finish_reason == c1.finish_reason
            assert c8.logprobs == pytest.approx(c1.logprobs, abs=1e-5)


def test_chained_multi_step_graphs_equal_one_step():
    """Fixed-length rows: every launch after the first is chained (queued before the host reads the previous
    one, continuing from the device state); the tokens equal one step per replay."""
    model = tiny_model("qwen2").to("cuda", torch.bfloat16)
    prompts = random_prompts([5, 30, 2, 17])
    params = SamplingParams(n=4, temperature=1.0, max_tokens=65, seed=2, ignore_eos=True)
    outs, chained_launches = {}, []
    for steps in (1, None):
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=16, max_model_len=128, max_num_seqs=32,
                              decode_steps=steps)
        launch = engine.runner.launch_multi
        engine.runner.launch_multi = lambda seqs, budgets, chained=False, launch=launch: (
            chained_launches.append(chained) or launch(seqs, budgets, chained))
        outs[steps] = engine.generate(prompts, params)
    assert chained_launches == [False] + [True] * 7  # 64 decoded tokens = 8 launches of 8
    for g1, g8 in zip(outs[1], outs[None]):
        for c1, c8 in zip(g1, g8):
            assert c8.token_ids == c1.token_ids
            assert c8.logprobs == pytest.approx(c1.logprobs, abs=1e-5)

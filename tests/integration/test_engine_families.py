"""CohortEngine on the families beyond dense Llama/Qwen (Mistral, Qwen2 with sliding layers, Gemma 3,
Qwen3-MoE), tiny float32 models on the CPU: greedy equals HF `generate` on prompts shorter and longer than
the sliding window, the window really changes the output, sampled logprobs equal the trainer's recompute,
preemption and multi-turn continuation keep working under a window, and the MoE's two expert paths agree."""

from __future__ import annotations

import pytest
import torch
from tests.integration.engine_models import (
    EOS,
    WINDOW,
    hf_greedy,
    random_prompts,
    recomputed_logprobs,
    tiny_model,
)

from cohort.engine import CohortEngine, engine_supports
from cohort.engine.attention import AttnContext, decode_gather, prefill_sdpa, window_mask
from cohort.types import SamplingParams

# Prompts of 2 to 25 tokens with 20 new ones: from well inside the window (7) to several windows long.
LENGTHS = [5, 11, 2, 17, 8, 25]
WINDOWED = ("mistral", "qwen2_sliding", "gemma3")


def make_engine(model, **kw) -> CohortEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return CohortEngine(model, eos_token_ids=[EOS], **kw)


def greedy(engine, prompts, max_tokens=20):
    return [g[0].token_ids for g in engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))]


@pytest.mark.parametrize("family", ["mistral", "qwen2_sliding", "gemma3", "qwen3_moe"])
def test_greedy_matches_hf_generate(family):
    model = tiny_model(family)
    assert engine_supports(model) == (True, "ok")
    prompts = random_prompts(LENGTHS, seed=2)
    assert greedy(make_engine(model), prompts) == hf_greedy(model, prompts, 20)


@pytest.mark.parametrize("family", WINDOWED)
def test_the_sliding_window_changes_the_output(family):
    """Guards the test above: with the windows dropped, the engine no longer matches HF on long prompts."""
    model = tiny_model(family)
    prompts = random_prompts([17, 25], seed=2)
    engine = make_engine(model)
    windows = engine.runner.net.windows
    assert WINDOW in windows
    if family == "gemma3":
        assert windows == [WINDOW, None, WINDOW]  # local, global, local
    engine.runner.net.windows = [None] * len(windows)
    assert greedy(engine, prompts) != hf_greedy(model, prompts, 20)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_sampled_logprobs_equal_trainer_recompute(family):
    model = tiny_model(family)
    prompts = random_prompts([4, 13], seed=3)
    out = make_engine(model).generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=15, seed=0,
                                                              ignore_eos=True))
    for prompt, group in zip(prompts, out):
        for completion in group:
            ref = recomputed_logprobs(model, prompt, completion.token_ids, 0.7)
            assert completion.logprobs == pytest.approx(ref, abs=2e-5)


def test_gemma3_final_logit_softcap_bounds_logits():
    model = tiny_model("gemma3")
    engine = make_engine(model)
    net = engine.runner.net
    assert net.softcap == 30.0
    hidden = torch.randn(3, model.config.hidden_size) * 50
    logits = net.logits(hidden)
    raw = model.lm_head(hidden)
    assert raw.abs().max() > 30 and logits.abs().max() <= 30
    assert torch.allclose(logits, torch.tanh(raw / 30) * 30, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_preemption_under_a_window_gives_the_same_tokens(family):
    model = tiny_model(family)
    prompts = random_prompts([6, 9, 12], seed=4)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)
    roomy = make_engine(model).generate(prompts, params)
    tight = make_engine(model, num_kv_blocks=9)
    cramped = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in g] for g in cramped] == [[c.token_ids for c in g] for g in roomy]


def test_multi_turn_continuation_under_a_window_matches_hf_reference():
    """A continued turn attends to its cached prefix through the block table (prefix_sdpa) with the window."""
    from tests.integration.test_engine_turns import STOPS, _Tok, scripted

    from cohort.engine.hf_backend import HFGenerateEngine

    model = tiny_model("mistral")
    prompts = random_prompts([7, 12])
    params = SamplingParams(n=1, temperature=0.0, max_tokens=40, stop_token_ids=STOPS)
    got = make_engine(model, max_model_len=160).generate_turns(prompts, params, scripted)
    ref = HFGenerateEngine(model, _Tok(), eos_token_ids=[EOS]).generate_turns(prompts, params, scripted)
    for (c,), (r,) in zip(got, ref):
        assert c.token_ids == r.token_ids and c.mask == r.mask
        assert len(c.token_ids) + 12 > WINDOW  # the conversations outgrow the window


def test_moe_grouped_matmuls_equal_the_per_expert_loop():
    from cohort.engine.models.qwen3_moe import _grouped_mm_fn, moe_experts, route

    if _grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped_mm")
    torch.manual_seed(0)
    experts, hidden, inter, tokens = 6, 16, 8, 23
    gate_up = torch.randn(experts, 2 * inter, hidden)
    down = torch.randn(experts, hidden, inter)
    router = torch.randn(experts, hidden)
    h = torch.randn(tokens, hidden)
    weights, ids = route(h, router, 2, True)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens))
    loop = moe_experts(h, weights, ids, gate_up, down, torch.nn.functional.silu, grouped=False)
    grouped = moe_experts(h, weights, ids, gate_up, down, torch.nn.functional.silu, grouped=True)
    # Reference by definition: every token through its two experts, weighted.
    ref = torch.zeros_like(h)
    for t in range(tokens):
        for j in range(2):
            e = ids[t, j]
            g, u = (gate_up[e] @ h[t]).chunk(2)
            ref[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    assert torch.allclose(loop, ref, atol=1e-4) and torch.allclose(grouped, ref, atol=1e-4)


def test_window_mask_by_hand():
    pos = torch.arange(5)
    # window 2: each query sees itself and the one before it
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(window_mask(pos, pos, 2).int(), expected)
    assert torch.equal(window_mask(pos, pos, None).int(), torch.ones(5, 5).tril().int())


def test_windowed_decode_equals_windowed_prefill_last_row():
    """decode_gather at ctx_len L with window W == the last row of a windowed prefill of L tokens."""
    torch.manual_seed(1)
    length, heads, kv_heads, dim, block = 11, 4, 2, 8, 4
    q = torch.randn(length, heads, dim)
    k = torch.randn(length, kv_heads, dim)
    v = torch.randn(length, kv_heads, dim)
    ctx = AttnContext(is_prefill=True, slot_mapping=torch.arange(length), cu_seqlens_host=[0, length])
    full = prefill_sdpa(q, k, v, ctx, 0.3, window=3)
    blocks = -(-length // block)
    k_cache = torch.zeros(blocks, block, kv_heads, dim)
    v_cache = torch.zeros(blocks, block, kv_heads, dim)
    k_cache.view(-1, kv_heads, dim)[:length] = k
    v_cache.view(-1, kv_heads, dim)[:length] = v
    dctx = AttnContext(is_prefill=False, slot_mapping=torch.tensor([length - 1]),
                       block_tables=torch.arange(blocks, dtype=torch.int32)[None], ctx_lens=torch.tensor([length]))
    out = decode_gather(q[-1:], k_cache, v_cache, dctx, 0.3, window=3)
    assert torch.allclose(out[0], full[-1], atol=1e-6)
    assert not torch.allclose(out[0], prefill_sdpa(q, k, v, ctx, 0.3)[-1], atol=1e-3)


def test_unsupported_gemma_variants_are_named():
    model = tiny_model("gemma3")
    model.config.attn_logit_softcapping = 50.0
    ok, reason = engine_supports(model)
    assert not ok and "attn_logit_softcapping" in reason
    model.config.attn_logit_softcapping = None
    model.config.use_bidirectional_attention = True
    ok, reason = engine_supports(model)
    assert not ok and "bidirectional" in reason


def test_gumbel_noise_is_finite_for_every_hash():
    """Found on Gemma's 262k vocabulary: u rounded to 1.0 gave +inf noise, and greedy (0 * inf = NaN) picked
    that token. The extreme hashes must stay inside (0, 1); large-vocabulary rows must have finite noise."""
    from cohort.engine.sampler import gumbel_noise, uniform_from_hash

    u = uniform_from_hash(torch.tensor([0, 1 << 9, 0xFFFFFFFF], dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    keys = torch.arange(64, dtype=torch.int64) * 7919 + 12345  # rows that held an inf with 24-bit uniforms
    assert torch.isfinite(gumbel_noise(keys, 262144)).all()


def test_gemma3_lora_adapters_apply_without_merging():
    peft = pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    model = tiny_model("gemma3")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                             init_lora_weights=False)
    lora = peft.get_peft_model(model, config).eval()
    prompts = random_prompts([5, 17], seed=2)
    engine = make_engine(lora)
    assert not engine.runner.net.fused
    expected = hf_greedy(lora, prompts, 12)
    assert greedy(engine, prompts, 12) == expected
    with lora.disable_adapter():
        assert hf_greedy(lora, prompts, 12) != expected


def test_qwen3_moe_grouped_path_in_the_engine_matches_hf_generate():
    """The grouped-matmul expert path (CUDA bf16's default) forced on in float32 on the CPU."""
    from cohort.engine.models.qwen3_moe import _grouped_mm_fn

    if _grouped_mm_fn() is None:
        pytest.skip("this torch has no grouped_mm")
    model = tiny_model("qwen3_moe")
    engine = make_engine(model)
    engine.runner.net.grouped = True
    prompts = random_prompts(LENGTHS, seed=2)
    assert greedy(engine, prompts) == hf_greedy(model, prompts, 20)

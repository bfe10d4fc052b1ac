"""triton_rope.rope_store_kv (RoPE on q and k plus the K/V cache write, one kernel) against the PyTorch path
it replaces, `layers.rope` + `attention.store_kv`, bit for bit, on the CPU under TRITON_INTERPRET=1.

The interpreter rounds float32 -> bfloat16 by truncation where the GPU's conversion rounds to nearest even,
so the fixture gives it the GPU's rounding (through torch); everything else is the interpreter's own.
Skips without Triton (it is not a project dependency; `pip install triton` to run these).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from cohort.engine import triton_rope
from cohort.engine.attention import store_kv
from cohort.engine.models.layers import rope

triton = pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")


@pytest.fixture
def interpreted(monkeypatch):
    """triton_rope with its kernel rebuilt for the interpreter (and rebuilt normally again afterwards)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "cast_impl"):
        pytest.skip(f"triton {triton.__version__}'s interpreter has no InterpreterBuilder.cast_impl to patch")
    cast = builder.cast_impl

    def cast_rne(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", cast_rne)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield importlib.reload(triton_rope)
    monkeypatch.delenv("TRITON_INTERPRET")
    importlib.reload(triton_rope)


def _case(tokens, heads, kv_heads, head_dim, dtype, block_size=16, blocks=12, seed=0):
    """A fused QKV output [T, (H + 2 Hkv) D] split into views (as the decoder does), RoPE tables built like
    HF's (cos/sin of duplicated frequencies, cast to the model dtype), caches and distinct scattered slots."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4000, (tokens,), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim), cos, sin, k_cache, v_cache, slots)


def _reference(q, k, v, cos, sin, k_cache, v_cache, slots):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rq, rk = rope(q, k, cos, sin)
    store_kv(k_cache, v_cache, rk, v, slots)
    return rq, rk, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (16, 8, 128), (4, 1, 256), (6, 2, 16)])
@pytest.mark.parametrize("tokens", [1, 37])
def test_matches_rope_then_store_kv_exactly(interpreted, dtype, heads, kv_heads, head_dim, tokens):
    q, k, v, cos, sin, k_cache, v_cache, slots = _case(tokens, heads, kv_heads, head_dim, dtype)
    rq, rk, rk_cache, rv_cache = _reference(q, k, v, cos, sin, k_cache, v_cache, slots)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    got_q, got_k = interpreted.rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert got_q.data_ptr() == q_ptr and got_k.data_ptr() == k_ptr  # rotated in place, in the QKV buffer
    assert torch.equal(got_q, rq)
    assert torch.equal(got_k, rk)
    assert torch.equal(k_cache, rk_cache)  # the new slots, and every other slot untouched
    assert torch.equal(v_cache, rv_cache)


def test_odd_shapes_and_strided_inputs(interpreted):
    """A head_dim whose half is not a power of two (masked lanes), 5 heads over 1, contiguous q/k/v (the
    unfused-projection path) and a cos/sin gathered from a larger table."""
    q, k, v, cos, sin, k_cache, v_cache, slots = _case(9, 5, 1, 96, torch.bfloat16, block_size=4)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    table_cos, table_sin = torch.cat([cos, cos]), torch.cat([sin, sin])
    cos, sin = table_cos[:9], table_sin[:9]
    rq, rk, rk_cache, rv_cache = _reference(q, k, v, cos, sin, k_cache, v_cache, slots)
    got_q, got_k = interpreted.rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got_q, rq) and torch.equal(got_k, rk)
    assert torch.equal(k_cache, rk_cache) and torch.equal(v_cache, rv_cache)


def test_rejects_mismatched_inputs(interpreted):
    q, k, v, cos, sin, k_cache, v_cache, slots = _case(3, 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match=r"cos is torch\.bfloat16"):
        interpreted.rope_store_kv(q, k, v, cos.bfloat16(), sin, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches"):
        interpreted.rope_store_kv(q, k, v, cos, sin, k_cache[..., :16], v_cache[..., :16], slots)


def test_switch(monkeypatch):
    cuda = torch.device("cuda")
    assert not triton_rope.fused_rope_kv_supported(torch.device("cpu"), 64)
    assert not triton_rope.fused_rope_kv_supported(cuda, 63)
    assert triton_rope.fused_rope_kv_supported(cuda, 64) == (triton_rope.triton is not None)
    monkeypatch.setenv(triton_rope.ENV_SWITCH, "0")
    assert not triton_rope.fused_rope_kv_supported(cuda, 64)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_engine_greedy_same_with_fused_kernel(interpreted, monkeypatch, family):
    """The whole engine on the CPU with the fused kernel forced on (prefill and decode; Qwen3 and Gemma 3
    apply it after their q/k norms) gives the unfused path's greedy tokens and the same logprobs."""
    from tests.integration.engine_models import EOS, random_prompts, tiny_model

    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams

    model = tiny_model(family)
    prompts = random_prompts([5, 11, 2])
    params = SamplingParams(temperature=0.0, max_tokens=8)
    calls = []
    kernel = interpreted.rope_store_kv
    monkeypatch.setattr(interpreted, "rope_store_kv", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    outs = []
    for fused in (False, True):
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=64, max_num_seqs=4,
                              fuse_projections=True)  # q, k, v as views of one QKV output
        assert not engine.runner.net.fused_rope_kv  # CPU default: the PyTorch path
        engine.runner.net.fused_rope_kv = fused
        outs.append(engine.generate(prompts, params))
    unfused, fused_out = outs
    layers = engine.runner.net.num_layers
    assert engine.runner.net.fused and calls[:1] == [18] and len(calls) >= 2 * layers  # prefill, then decodes
    assert [g[0].token_ids for g in fused_out] == [g[0].token_ids for g in unfused]
    assert [g[0].logprobs for g in fused_out] == [g[0].logprobs for g in unfused]


def test_engine_multi_turn_same_with_fused_kernel(interpreted):
    """Continued turns: their new tokens are written by the kernel, then attend over the cached prefix."""
    from tests.integration.engine_models import EOS, random_prompts, tiny_model
    from tests.integration.test_engine_turns import STOPS, scripted

    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams

    model = tiny_model("llama")
    prompts = random_prompts([7, 12])
    params = SamplingParams(n=2, temperature=0.8, max_tokens=40, seed=1, stop_token_ids=STOPS)
    outs = []
    for fused in (False, True):
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=160, max_num_seqs=4,
                              fuse_projections=True)
        engine.runner.net.fused_rope_kv = fused
        outs.append(engine.generate_turns(prompts, params, scripted))
    unfused, fused_out = outs
    assert [[(c.token_ids, c.mask, c.logprobs) for c in g] for g in fused_out] == \
        [[(c.token_ids, c.mask, c.logprobs) for c in g] for g in unfused]
    assert sum(c.mask.count(0) for g in fused_out for c in g) > 0  # tool turns were appended and continued

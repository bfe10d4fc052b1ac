"""triton_qkv.qkv_rope_store (QKV projection + bias + RoPE + K/V cache write, one kernel, for decode steps)
against the path it replaces, `F.linear` then `layers.rope` + `attention.store_kv`, on the CPU under
TRITON_INTERPRET=1 (in a child process: this file run as a script, with the GPU's float32 -> bfloat16
rounding given to the interpreter):

- bit for bit where the products are exact (small integers: any summation order gives the same sums), in
  bfloat16 and float32, with and without bias, several head shapes and row counts (one program and several);
- within float32 rounding on random values;
- the whole engine with the kernel forced on for its decode steps: the same greedy tokens and logprobs as the
  unfused path.
The kernel is also built for an H100 on the CPU (the interpreter accepts kernels the compiler refuses).
Skips without Triton."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import run_interpreted


def _case(rows, heads, kv_heads, head_dim, hidden, dtype, bias, integer, block_size=4, blocks=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = (heads + 2 * kv_heads) * head_dim

    def values(*shape):
        if integer:  # exact products and sums (|sum| <= 2 x 2 x hidden + 2 < 256: exact in bfloat16 too)
            return torch.randint(-2, 3, shape, generator=g).to(dtype)
        return torch.randn(*shape, generator=g).to(dtype)

    x, w = values(rows, hidden), values(out, hidden)
    b = values(out) if bias else None
    positions = torch.randint(0, 4000, (rows,), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:rows]
    return x, w, b, cos, sin, k_cache, v_cache, slots


def _reference(x, w, b, cos, sin, k_cache, v_cache, slots, heads, kv_heads):
    import torch.nn.functional as F

    from cohort.engine.attention import store_kv
    from cohort.engine.models.layers import rope

    head_dim = k_cache.shape[-1]
    rows = x.shape[0]
    q, k, v = F.linear(x, w, b).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = rope(q.reshape(rows, heads, head_dim), k.reshape(rows, kv_heads, head_dim), cos, sin)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    store_kv(k_cache, v_cache, k, v.reshape(rows, kv_heads, head_dim), slots)
    return q, k_cache, v_cache


SHAPES = [(14, 2, 64, 64), (3, 1, 32, 48), (4, 2, 128, 32)]  # (heads, kv heads, head dim, hidden)


def _check_exact(triton_qkv) -> None:
    for heads, kv_heads, head_dim, hidden in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for rows, bias in ((1, True), (37, False), (130, True)):  # 130 rows: several row tiles of 32
                case = _case(rows, heads, kv_heads, head_dim, hidden, dtype, bias, integer=True)
                want_q, want_k, want_v = _reference(*case, heads, kv_heads)
                x, w, b, cos, sin, k_cache, v_cache, slots = case
                q = triton_qkv.qkv_rope_store(x, w, b, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
                where = (heads, kv_heads, head_dim, dtype, rows, bias)
                assert torch.equal(q, want_q), where
                assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), where


def _check_close() -> None:
    from cohort.engine import triton_qkv

    case = _case(19, 6, 2, 32, 80, torch.float32, True, integer=False)
    want_q, want_k, want_v = _reference(*case, 6, 2)
    x, w, b, cos, sin, k_cache, v_cache, slots = case
    q = triton_qkv.qkv_rope_store(x, w, b, cos, sin, k_cache, v_cache, slots, 6, 2, block_rows=16, block_k=32)
    for got, want in ((q, want_q), (k_cache, want_k), (v_cache, want_v)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def _check_engine() -> None:
    from tests.integration.engine_models import EOS, random_prompts
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cohort.engine import CohortEngine
    from cohort.types import SamplingParams

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=96, num_hidden_layers=2, intermediate_size=128,
                                         num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                                         initializer_range=0.1, max_position_embeddings=256, eos_token_id=EOS,
                                         tie_word_embeddings=True))
    from cohort.engine import triton_qkv

    prompts = random_prompts([5, 11, 2])
    calls, kernel = [], triton_qkv.qkv_rope_store
    triton_qkv.qkv_rope_store = lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k)
    outs = []
    for fused in (False, True):
        engine = CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=64, max_num_seqs=4,
                              fuse_projections=True)
        assert not engine.runner.net.fused_qkv_rope  # CPU default: the PyTorch path
        engine.runner.net.fused_qkv_rope = fused
        outs.append(engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8)))
    triton_qkv.qkv_rope_store = kernel
    assert len(calls) >= 2 * 7 and set(calls) <= {1, 2, 3}  # 2 layers x 7+ decode steps; never a prefill
    unfused, fused = outs
    assert [g[0].token_ids for g in fused] == [g[0].token_ids for g in unfused]
    torch.testing.assert_close(torch.tensor([g[0].logprobs for g in fused]),
                               torch.tensor([g[0].logprobs for g in unfused]), atol=1e-5, rtol=1e-5)


def test_kernel_equals_projection_then_rope_and_store():
    pytest.importorskip("triton")
    run_interpreted(__file__, "qkv ok")


@pytest.mark.parametrize("bias", [True, False])
def test_kernel_builds_for_the_h100(bias):
    pytest.importorskip("triton")
    from tests.helpers.triton_compile import compile_for_h100

    from cohort.engine.triton_qkv import _qkv_rope_store_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                "slot_ptr": "*i64", "q_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16"}
    constexprs = {"HEADS": 14, "KV_HEADS": 2, "HALF": 32, "HAS_BIAS": bias, "PRECISION": "tf32", "BM": 32, "BK": 64}
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32")
                 for name in _qkv_rope_store_kernel.arg_names}
    assert "cubin" in compile_for_h100(_qkv_rope_store_kernel, signature, constexprs).asm


def test_switch(monkeypatch):
    from cohort.engine import triton_qkv

    cuda = torch.device("cuda")
    assert not triton_qkv.fused_qkv_rope_supported(torch.device("cpu"), 64)
    assert not triton_qkv.fused_qkv_rope_supported(cuda, 96)  # half of 48: not a power of two
    assert not triton_qkv.fused_qkv_rope_supported(cuda, 16)  # half of 8: below the smallest dot tile
    assert triton_qkv.fused_qkv_rope_supported(cuda, 64) == (triton_qkv.triton is not None)
    monkeypatch.setenv(triton_qkv.ENV_SWITCH, "0")
    assert not triton_qkv.fused_qkv_rope_supported(cuda, 64)


if __name__ == "__main__":
    from tests.helpers.triton_interpreter import patch_interpreter_bf16_rounding, patch_interpreter_index

    patch_interpreter_index()
    patch_interpreter_bf16_rounding()
    from cohort.engine import triton_qkv as _qkv

    _check_exact(_qkv)
    _check_close()
    _check_engine()
    print("qkv ok")

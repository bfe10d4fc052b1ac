"""A slower packed-attention path taken on CUDA says so, once per reason: the per-segment SDPA loop instead of a
flash varlen kernel (float32 activations, or a torch without varlen_attn), and KV heads expanded where the kernel
does not take grouped ones. On the CPU the loop is the designed path and stays silent. The CUDA decision is
forced here by monkeypatching the device check, so this runs on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from cohort.forward import packed_attention as pa


def packed_call(dtype=torch.float32, **attention_kwargs):
    """varlen_attention_forward on one packed row of two sequences (3 + 2 tokens), 2 heads of 4 dims."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen).to(dtype) for _ in range(3))
    module = type("Attn", (), {"config": object()})()
    cu = torch.tensor([0, 3, 5])
    out, _ = pa.varlen_attention_forward(module, q, k, v, None, scaling=0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                         max_length_q=3, max_length_k=3, **attention_kwargs)
    return out


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(pa, "_WARNED", set())


def slow_path_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "packed attention on CUDA" in str(w.message)]


def test_cpu_fallback_is_silent(fresh):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        packed_call()
    assert slow_path_warnings(record) == []


def test_float32_on_cuda_warns_once_naming_the_path_and_the_reason(fresh, monkeypatch):
    monkeypatch.setattr(pa, "_on_cuda", lambda query: True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = packed_call()
        packed_call()  # the same reason again: no second warning
    messages = slow_path_warnings(record)
    assert len(messages) == 1, messages
    assert "per-segment SDPA loop" in messages[0] and "torch.float32" in messages[0]
    assert "model.dtype=bfloat16" in messages[0]  # and the fix
    monkeypatch.setattr(pa, "_on_cuda", lambda query: False)
    assert torch.equal(first, packed_call())  # the message changes nothing computed


def test_missing_varlen_kernel_on_cuda_is_its_own_reason(fresh, monkeypatch):
    monkeypatch.setattr(pa, "_on_cuda", lambda query: True)
    monkeypatch.setattr(pa, "varlen_attn", None)  # an older torch
    with pytest.warns(RuntimeWarning, match=r"per-segment SDPA loop.*no torch\.nn\.attention\.varlen\.varlen_attn"):
        packed_call(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"bfloat16/float16 and this forward runs in torch\.float32"):
        packed_call(torch.float32)  # another reason: announced too


def test_a_logit_softcap_on_cuda_announces_the_explicit_softmax(fresh, monkeypatch):
    monkeypatch.setattr(pa, "_on_cuda", lambda query: True)
    with pytest.warns(RuntimeWarning, match=r"explicit per-segment softmax.*attention sinks or a logit softcap"):
        packed_call(torch.bfloat16, softcap=30.0)


def test_flash_path_is_silent(fresh, monkeypatch):
    monkeypatch.setattr(pa, "_on_cuda", lambda query: True)
    monkeypatch.setattr(pa, "_flash_eligible", lambda query: True)
    assert pa._slow_path_reason(torch.zeros(1, dtype=torch.bfloat16)) is None


def test_expanded_kv_heads_are_announced(fresh, monkeypatch):
    """prepare_flash finding that varlen_attn cannot take grouped KV heads (forced) says the heads expand."""
    monkeypatch.setitem(pa.GROUPED_KV, "native", None)
    monkeypatch.setattr(pa, "_has_varlen_attn", lambda: True)
    monkeypatch.setattr(pa, "_varlen_has_gqa_keyword", lambda: False)
    monkeypatch.setattr(pa, "_grouped_kv_works", lambda device: False)
    with pytest.warns(RuntimeWarning, match="KV heads are expanded.*neither takes enable_gqa"):
        pa.prepare_flash(torch.device("cuda"))
    assert pa.GROUPED_KV["native"] is False
    monkeypatch.setitem(pa.GROUPED_KV, "native", None)
    monkeypatch.setattr(pa, "_grouped_kv_works", lambda device: True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pa.prepare_flash(torch.device("cuda"))
    assert slow_path_warnings(record) == [] and pa.GROUPED_KV["native"] is True

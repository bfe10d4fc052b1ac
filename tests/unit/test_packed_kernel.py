"""model.packed_attention: the choice of the packed forward's CUDA kernel is checked before any model loads
(field, value and fix in the error), and the FlashAttention-4 path hands the kernel the right arguments:
the packed boundaries, causal, the sliding window as (W - 1, 0), the scale, and grouped KV heads unexpanded.
FA4 itself needs a Hopper GPU (tests/gpu/test_packing_gpu.py); here a stand-in computes exact attention."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import cohort.packed_attention as pa
from cohort.config import load_config
from cohort.errors import ConfigError


@pytest.fixture(autouse=True)
def _restore_kernel():
    before = pa.packed_kernel()
    yield
    pa._KERNEL["name"] = before


def _fake_fa4(monkeypatch, calls):
    """A flash_attn.cute whose varlen function is exact causal (windowed) attention over each sequence."""

    def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale, causal, window_size):
        calls.append({"kv_heads": k.shape[1], "q_heads": q.shape[1], "cu": cu_seqlens_q.tolist(),
                      "same_cu": cu_seqlens_k is cu_seqlens_q, "max": (max_seqlen_q, max_seqlen_k),
                      "scale": softmax_scale, "causal": causal, "window": window_size})
        left = window_size[0]
        out = pa._segment_sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                               cu_seqlens_q, softmax_scale, None if left is None else left + 1)
        return out[0], torch.zeros(1)  # (out, lse), as some releases return

    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


def test_config_rejects_an_unknown_kernel_by_field():
    with pytest.raises(ConfigError, match="packed_attention"):
        load_config(None, ["model.packed_attention=fa5"])
    assert load_config(None, ["model.packed_attention=fa4"]).model.packed_attention == "fa4"


def test_fa4_on_the_cpu_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"model\.packed_attention='fa4'.*cpu.*model\.packed_attention=torch"):
        pa.use_packed_kernel("fa4", "cpu")
    assert pa.packed_kernel() == "torch"


def test_fa4_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install flash-attn-4"):
        pa.use_packed_kernel("fa4", "cuda")
    assert pa.packed_kernel() == "torch"
    with pytest.raises(ConfigError, match="choose one of torch, fa4"):
        pa.use_packed_kernel("flash", "cuda")


@pytest.mark.parametrize("window", [None, 6])
def test_fa4_path_passes_boundaries_window_and_grouped_heads(monkeypatch, window):
    calls: list[dict] = []
    _fake_fa4(monkeypatch, calls)
    pa.use_packed_kernel("fa4", "cuda")
    assert pa.packed_kernel() == "fa4"
    monkeypatch.setattr(pa, "_flash_eligible", lambda query: True)  # the CUDA branch, on the CPU
    g = torch.Generator().manual_seed(0)
    lens = [5, 11, 3]
    total, hq, hk, d = sum(lens), 4, 2, 8
    cu = torch.tensor([0, 5, 16, 19])
    q, k, v = (torch.randn(1, h, total, d, generator=g) for h in (hq, hk, hk))  # transformers' [B, H, T, D]
    module = types.SimpleNamespace(config=types.SimpleNamespace())
    out, _ = pa.varlen_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                         max_length_q=11, max_length_k=11, sliding_window=window)
    (call,) = calls
    assert call["q_heads"] == hq and call["kv_heads"] == hk  # grouped in the kernel, not expanded
    assert call["cu"] == [0, 5, 16, 19] and call["same_cu"] and call["max"] == (11, 11)
    assert call["scale"] == 0.3 and call["causal"] is True
    assert call["window"] == ((None, 0) if window is None else (window - 1, 0))
    expected = pa._segment_sdpa(q, k, v, cu, 0.3, window)  # [1, T, Hq, D]
    torch.testing.assert_close(out, expected)

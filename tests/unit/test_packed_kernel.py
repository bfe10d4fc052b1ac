"""model.packed_attention: the choice of the packed forward's CUDA kernel is checked before any model loads
(field, value and fix in the error), and the FlashAttention-4 path hands the kernel the right arguments:
the packed boundaries, causal, the sliding window as (W - 1, 0), the scale, and grouped KV heads unexpanded.
FA4 itself needs a Hopper GPU (tests/gpu/test_packing_gpu.py); here a stand-in computes exact attention."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch

import cohort.forward.packed_attention as pa
from cohort.config import load_config
from cohort.errors import ConfigError


@pytest.fixture(autouse=True)
def _restore_kernel():
    before = pa.packed_kernel()
    yield
    pa._KERNEL["name"] = before


def _reference(q, k, v, cu, scale, window_left):
    """Exact causal (windowed) attention per packed sequence on [T, H, D]: out [T, Hq, D] and lse [Hq, T]."""
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    bounds = cu.tolist()
    for a, b in itertools.pairwise(bounds):
        qs = q[a:b].transpose(0, 1)  # [Hq, L, D]
        ks = k[a:b].transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[a:b].transpose(0, 1).repeat_interleave(rep, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        pos = torch.arange(b - a)
        visible = pos[None, :] <= pos[:, None]
        if window_left is not None:
            visible &= pos[None, :] >= pos[:, None] - window_left
        scores = scores.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses, dim=1)


def _fake_fa4(monkeypatch, calls):
    """A flash_attn.cute.interface whose forward and backward are exact attention (FA4's call signatures)."""

    def _flash_attn_fwd(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                        causal, window_size_left, window_size_right, return_lse):
        calls.append({"kv_heads": k.shape[1], "q_heads": q.shape[1], "cu": cu_seqlens_q.tolist(),
                      "same_cu": cu_seqlens_k is cu_seqlens_q, "max": (max_seqlen_q, max_seqlen_k),
                      "scale": softmax_scale, "causal": causal, "window": (window_size_left, window_size_right),
                      "return_lse": return_lse, "dtype": cu_seqlens_q.dtype})
        out, lse = _reference(q, k, v, cu_seqlens_q, softmax_scale, window_size_left)
        return out, lse.float(), None, None, None  # FA4 keeps the log-sum-exp in float32

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, *, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        calls.append({"backward": True, "causal": causal, "softcap": softcap, "lse_shape": tuple(lse.shape)})
        # autograd does not record below a custom op: attention's gradient written out, per sequence
        rep = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        bounds = cu_seqlens_q.tolist()
        for a, b in itertools.pairwise(bounds):
            qs, do = q[a:b].transpose(0, 1), dout[a:b].transpose(0, 1)  # [Hq, L, D]
            ks = k[a:b].transpose(0, 1).repeat_interleave(rep, 0)
            vs = v[a:b].transpose(0, 1).repeat_interleave(rep, 0)
            probs = torch.exp(qs @ ks.transpose(1, 2) * softmax_scale - lse[:, a:b, None])  # masked: exp(-inf)
            pos = torch.arange(b - a)
            visible = pos[None, :] <= pos[:, None]
            if window_size_left is not None:
                visible &= pos[None, :] >= pos[:, None] - window_size_left
            probs = probs * visible
            dprobs = do @ vs.transpose(1, 2)
            dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
            dq[a:b] = (dscores @ ks * softmax_scale).transpose(0, 1)
            dk_full = dscores.transpose(1, 2) @ qs * softmax_scale  # [Hq, L, D]: sum over each KV head's group
            dv_full = probs.transpose(1, 2) @ do
            dk[a:b] = dk_full.unflatten(0, (k.shape[1], rep)).sum(1).transpose(0, 1)
            dv[a:b] = dv_full.unflatten(0, (k.shape[1], rep)).sum(1).transpose(0, 1)
        return dq, dk, dv

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)


def _packed_qkv(hq=4, hk=2, d=8, lens=(5, 11, 3)):
    g = torch.Generator().manual_seed(0)
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, h, d, generator=g).requires_grad_() for h in (hq, hk, hk))
    return q, k, v, cu, max(lens)


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
    total, hq, hk, d = 19, 4, 2, 8
    cu = torch.tensor([0, 5, 16, 19])
    q, k, v = (torch.randn(1, h, total, d, generator=g) for h in (hq, hk, hk))  # transformers' [B, H, T, D]
    module = types.SimpleNamespace(config=types.SimpleNamespace())
    out, _ = pa.varlen_attention_forward(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                         max_length_q=11, max_length_k=11, sliding_window=window)
    (call,) = calls
    assert call["q_heads"] == hq and call["kv_heads"] == hk  # grouped in the kernel, not expanded
    assert call["cu"] == [0, 5, 16, 19] and call["dtype"] == torch.int32 and call["same_cu"]
    assert call["max"] == (11, 11) and call["scale"] == pytest.approx(0.3) and call["causal"] is True
    assert call["window"] == ((None, 0) if window is None else (window - 1, 0)) and call["return_lse"] is True
    expected = pa._segment_sdpa(q, k, v, cu, cu, 0.3, window)  # [1, T, Hq, D]
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("window", [None, 4])
def test_fa4_ops_backward_is_exact_attention_gradient(monkeypatch, window):
    """The custom ops' autograd: FA4's backward gets the forward's out and lse, and the gradients reaching
    q, k and v are those of exact attention."""
    from cohort.forward.fa4_attention import fa4_varlen

    calls: list[dict] = []
    _fake_fa4(monkeypatch, calls)
    q, k, v, cu, max_len = _packed_qkv()
    out = fa4_varlen(q, k, v, cu, max_len, 0.25, window)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [t.grad.clone() for t in (q, k, v)]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, _ = _reference(*leaves, cu, 0.25, None if window is None else window - 1)
    ref.backward(grad)
    torch.testing.assert_close(out, ref)
    for a, b in zip(got, (t.grad for t in leaves), strict=True):
        torch.testing.assert_close(a, b)
    assert calls[-1]["backward"] and calls[-1]["causal"] is True and calls[-1]["lse_shape"] == (4, 19)


def test_fa4_ops_compile_into_one_graph(monkeypatch):
    """Inside torch.compile the ops are opaque nodes with fake shapes: fullgraph compiles (no graph break),
    forward and backward match eager."""
    from cohort.forward.fa4_attention import fa4_varlen, fa4_varlen_fwd

    calls: list[dict] = []
    _fake_fa4(monkeypatch, calls)
    q, k, v, cu, max_len = _packed_qkv()

    def layer(q, k, v):
        return (fa4_varlen(q * 1.5, k, v, cu, max_len, 0.25) * 2).sum()

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = layer(q, k, v)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for a, t in zip(got, (q, k, v), strict=True):
        torch.testing.assert_close(a, t.grad)
    torch.library.opcheck(fa4_varlen_fwd, (q.detach(), k.detach(), v.detach(), cu, max_len, 0.25, -1, cu, max_len),
                          test_utils=("test_schema", "test_faketensor"))

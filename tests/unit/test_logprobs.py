"""Chunked selective logprobs/entropy equal the full-logits computation, values and gradients."""

import math

import pytest
import torch

import cohort.forward.logprobs as lp_mod
from cohort.forward.logprobs import full_logprobs_and_entropy, selective_logprobs_and_entropy


def _inputs(n=37, d=16, v=50, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(v, d, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    return h, w, labels


@pytest.mark.parametrize("kernels", ["eager", "fused"])
@pytest.mark.parametrize("chunk", [1, 5, 37, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_full_values_and_grads(chunk, temperature, kernels, monkeypatch):
    if kernels == "fused":  # the functional code torch.compile fuses on CUDA, run eagerly here
        monkeypatch.setattr(lp_mod, "_kernels", lambda device: (lp_mod._stats_fused, lp_mod._grad_fused))
    h, w, labels = _inputs()
    lp, ent = selective_logprobs_and_entropy(h, w, labels, temperature=temperature, chunk_tokens=chunk)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(lp.shape, generator=g, dtype=torch.float64), torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ((lp * a).sum() + (ent * b).sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp_ref, ent_ref = full_logprobs_and_entropy(h, w, labels, temperature=temperature)
    ((lp_ref * a).sum() + (ent_ref * b).sum()).backward()
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-4)  # fp32 softmax, logits up to ~20
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-4)


def test_gradcheck_float64():
    h, w, labels = _inputs(n=6, d=4, v=7)

    def fn(h, w):
        lp, ent = selective_logprobs_and_entropy(h, w, labels, temperature=0.9, chunk_tokens=4)
        return lp.double(), ent.double()

    # Outputs are fp32 by design, so compare numerically with float-level tolerances.
    assert torch.autograd.gradcheck(fn, (h, w), eps=1e-3, atol=1e-3, rtol=1e-2)


def test_uniform_logits_hand_values():
    # Zero weights: every logit is 0, so logp = -log(V) and entropy = log(V) for every token.
    h = torch.randn(3, 4)
    w = torch.zeros(8, 4)
    lp, ent = selective_logprobs_and_entropy(h, w, torch.tensor([0, 3, 7]), chunk_tokens=2)
    assert torch.allclose(lp, torch.full((3,), -math.log(8)))
    assert torch.allclose(ent, torch.full((3,), math.log(8)))


def test_no_entropy_and_only_logprob_grad():
    h, w, labels = _inputs(dtype=torch.float32)
    lp, ent = selective_logprobs_and_entropy(h, w, labels, chunk_tokens=8, compute_entropy=False)
    assert ent is None
    lp.sum().backward()
    gh = h.grad.clone()
    h.grad = w.grad = None
    full_logprobs_and_entropy(h, w, labels)[0].sum().backward()
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_close_to_fp32():
    h, w, labels = _inputs(n=20, d=32, v=64, dtype=torch.float32)
    lp32, _ = selective_logprobs_and_entropy(h, w, labels)
    lp16, ent16 = selective_logprobs_and_entropy(h.bfloat16(), w.bfloat16(), labels, chunk_tokens=7)
    assert lp16.dtype == torch.float32 and ent16.dtype == torch.float32
    assert (lp16 - lp32).abs().max().item() < 0.5
    lp16.sum().backward()


def test_rejects_bad_arguments():
    h, w, labels = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        selective_logprobs_and_entropy(h, w, labels, temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        selective_logprobs_and_entropy(h, w, labels[:-1])


def test_saves_no_logits_for_backward():
    # What autograd keeps for the backward must be the inputs only, never [N, V] logits.
    h, w, labels = _inputs(n=64, d=8, v=500, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        selective_logprobs_and_entropy(h * 1.0, w, labels, chunk_tokens=16)
    assert sum(saved) <= h.numel() + w.numel() + labels.numel() + h.numel()
    assert max(saved) < 64 * 500


def test_lm_head_grad_summed_in_weight_dtype():
    """lm_head_grad_fp32=False (low-memory setting): fp32 weights give the identical gradient; bf16 weights
    a gradient within bf16 rounding of the fp32-summed one."""
    h, w, labels = _inputs(n=40, d=16, v=48, dtype=torch.float32)
    grads = []
    for fp32_sum in (True, False):
        h.grad = w.grad = None
        lp, _ = selective_logprobs_and_entropy(h, w, labels, chunk_tokens=7, lm_head_grad_fp32=fp32_sum)
        lp.sum().backward()
        grads.append(w.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    hb, wb = h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    grads = []
    for fp32_sum in (True, False):
        wb.grad = None
        lp, _ = selective_logprobs_and_entropy(hb, wb, labels, chunk_tokens=7, lm_head_grad_fp32=fp32_sum)
        lp.sum().backward()
        assert wb.grad.dtype == torch.bfloat16
        grads.append(wb.grad.float())
    scale = grads[0].abs().max()
    assert (grads[0] - grads[1]).abs().max() <= 0.05 * scale  # six chunk sums rounded to bf16
    assert (grads[0] - grads[1]).abs().max() > 0  # ...and it really took the other path

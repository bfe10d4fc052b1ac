"""CUDA checks of the logprob kernel's keep_logits mode (compiled gradient kernel, bf16) and of the LM-head
gradient accumulated by torch.addmm(..., out_dtype=float32) where torch offers it."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import cohort.forward.logprobs as lp_mod
from cohort.forward.logprobs import selective_logprobs_and_entropy

DEV = torch.device("cuda")


def _inputs(n=1000, d=256, v=4000):
    g = torch.Generator(device=DEV).manual_seed(0)
    h = torch.randn(n, d, device=DEV, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(v, d, device=DEV, generator=g) * 0.1).bfloat16().requires_grad_()
    return h, w, torch.randint(0, v, (n,), device=DEV, generator=g)


def _grads(h, w, labels, keep):
    h.grad = w.grad = None
    lp, ent = selective_logprobs_and_entropy(h, w, labels, temperature=0.8, chunk_tokens=384, keep_logits=keep)
    (lp.sum() + 0.3 * ent.sum()).backward()
    return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()


def test_keep_logits_equals_recompute_on_cuda():
    h, w, labels = _inputs()  # 1000 tokens in chunks of 384: a ragged last chunk of 232
    for a, b in zip(_grads(h, w, labels, False), _grads(h, w, labels, True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kept_logits_are_freed_by_the_backward():
    h, w, labels = _inputs(n=4096, d=512, v=32000)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    lp, ent = selective_logprobs_and_entropy(h, w, labels, chunk_tokens=1024, keep_logits=True)
    held = torch.cuda.memory_allocated() - before
    kept = 4096 * 32000 * 2
    assert kept <= held < kept + 2**20  # the logits (bf16) plus per-token scalars
    (lp.sum() + ent.sum()).backward()
    del lp, ent
    grads = h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size()
    assert torch.cuda.memory_allocated() - before <= grads + 2**20


def test_fp32_out_addmm_lm_head_gradient():
    """Where the probe finds torch.addmm(fp32 C, bf16, bf16, out_dtype=float32) (torch >= 2.9-ish), the weight
    gradient summed by it is as close to the float64 one as the bf16-product sum, or closer."""
    supported = lp_mod._fp32_out_addmm(DEV)
    print(f"torch {torch.__version__}: fp32-out addmm {'used' if supported else 'not available'}")
    if not supported:
        pytest.skip(f"torch {torch.__version__} has no fp32-output addmm for bf16 inputs on CUDA")
    h, w, labels = _inputs()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t() / 0.8, dim=-1)
    (logp.gather(-1, labels[:, None]).sum() + 0.3 * -(logp.exp() * logp).sum()).backward()
    errors = {}
    try:
        for fp32_out in (False, True):
            lp_mod._FP32_OUT_ADDMM[DEV] = fp32_out
            errors[fp32_out] = (_grads(h, w, labels, True)[3].double() - w64.grad).abs().max().item()
    finally:
        lp_mod._FP32_OUT_ADDMM.clear()
    scale = w64.grad.abs().max().item()
    assert errors[True] <= 0.02 * scale  # within the final bf16 rounding of the gradient
    assert errors[True] <= errors[False] * 1.5

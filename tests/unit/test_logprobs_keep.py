"""keep_logits (train.keep_logits): the logprob kernel keeps its forward logits for the backward instead of
recomputing them. The results must not change, the kept chunks must be gone after the backward, and the
config field must reach the kernel."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cohort.forward.logprobs as lp_mod
import cohort.forward.packing as packing
from cohort.forward.logprobs import selective_logprobs_and_entropy


def _inputs(dtype, n=37, d=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).to(dtype).requires_grad_()
    w = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    return h, w, torch.randint(0, v, (n,), generator=g)


def _run(h, w, labels, *, keep, entropy_grad, temperature=0.7, chunk=8, fp32_sum=True):
    h.grad = w.grad = None
    lp, ent = selective_logprobs_and_entropy(h, w, labels, temperature=temperature, chunk_tokens=chunk,
                                             lm_head_grad_fp32=fp32_sum, keep_logits=keep)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    loss = (lp * a).sum() + ((ent * b).sum() if entropy_grad else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()


@pytest.mark.parametrize("kernels", ["eager", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("fp32_sum", [True, False])
def test_keep_logits_gives_the_same_values_and_gradients(kernels, dtype, entropy_grad, fp32_sum, monkeypatch):
    if kernels == "fused":  # the functional code torch.compile fuses on CUDA, run eagerly here
        monkeypatch.setattr(lp_mod, "_kernels", lambda device: (lp_mod._stats_fused, lp_mod._grad_fused))
    h, w, labels = _inputs(dtype)  # 37 tokens in chunks of 8: four whole chunks and a ragged one of 5
    recompute = _run(h, w, labels, keep=False, entropy_grad=entropy_grad, fp32_sum=fp32_sum)
    kept = _run(h, w, labels, keep=True, entropy_grad=entropy_grad, fp32_sum=fp32_sum)
    # the kept logits are the very matmul the backward would redo: identical results, not merely close
    for a, b in zip(recompute, kept):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _spy_logits(monkeypatch) -> list[weakref.ref]:
    """Weak references to every chunk of logits the forward makes (the first argument of its statistics)."""
    refs: list[weakref.ref] = []
    call = lp_mod._call

    def spy(which, device, *args, **kwargs):
        if which == 0:
            refs.append(weakref.ref(args[0]))
        return call(which, device, *args, **kwargs)

    monkeypatch.setattr(lp_mod, "_call", spy)
    return refs


def _alive(refs) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_live_until_the_backward_and_no_longer(dtype, monkeypatch):
    refs = _spy_logits(monkeypatch)
    h, w, labels = _inputs(dtype)
    lp, ent = selective_logprobs_and_entropy(h, w, labels, chunk_tokens=8, keep_logits=True)
    assert len(refs) == 5 and _alive(refs) == 5  # every chunk, held for the backward
    node = lp.grad_fn
    while not hasattr(node, "kept_logits"):  # the kernel's node, under the output's reshape
        node = node.next_functions[0][0]
    assert len(node.kept_logits) == 5
    (lp.sum() + ent.sum()).backward()
    assert node.kept_logits is None and _alive(refs) == 0


def test_nothing_kept_without_keep_logits_or_without_grad(monkeypatch):
    refs = _spy_logits(monkeypatch)
    h, w, labels = _inputs(torch.float32)
    lp, _ = selective_logprobs_and_entropy(h, w, labels, chunk_tokens=8)
    assert lp.grad_fn is not None and _alive(refs) == 0  # the graph lives on, without the logits
    with torch.no_grad():  # old / reference logprobs: no backward will come
        selective_logprobs_and_entropy(h, w, labels, chunk_tokens=8, keep_logits=True)
    assert _alive(refs) == 0
    selective_logprobs_and_entropy(h.detach(), w.detach(), labels, chunk_tokens=8, keep_logits=True)
    assert _alive(refs) == 0


def test_second_backward_over_a_retained_graph_recomputes():
    h, w, labels = _inputs(torch.float32)
    lp, ent = selective_logprobs_and_entropy(h, w, labels, temperature=0.7, chunk_tokens=8, keep_logits=True)
    loss = lp.sum() + 0.5 * ent.sum()
    loss.backward(retain_graph=True)
    first = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    loss.backward()  # the kept chunks went with the first backward: this one recomputes them
    torch.testing.assert_close(h.grad, first[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, first[1], rtol=0, atol=0)


def test_fp32_out_addmm_probe_is_cuda_only():
    assert lp_mod._fp32_out_addmm(torch.device("cpu")) is False


def test_train_keep_logits_reaches_the_kernel(tmp_path, monkeypatch):
    """train.keep_logits travels trainer -> UpdateSettings -> packed forward -> the logprob kernel, for the
    update's forwards (with grad) only."""
    from tests.integration.test_trainer_learns import toy_components, toy_config

    from cohort.trainer import train

    seen: list[tuple[bool, bool]] = []
    kernel = packing.selective_logprobs_and_entropy

    def spy(*args, **kwargs):
        seen.append((kwargs.get("keep_logits", False), torch.is_grad_enabled()))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(packing, "selective_logprobs_and_entropy", spy)
    for keep in (False, True):
        cfg = toy_config(tmp_path / str(keep), steps=1)
        cfg.train.keep_logits = keep
        seen.clear()
        train(cfg.validate(), toy_components(cfg))
        assert any(grad for _, grad in seen)  # the update ran its forwards through the kernel
        assert {k for k, grad in seen if grad} == {keep}


def test_keep_logits_warns_where_soft_capping_ignores_it():
    """Final-logit soft-capping (Gemma) takes its own recomputing path: keep_logits is said to do nothing."""
    from tests.helpers.tiny_models import tiny_llama

    model = tiny_llama(0)
    model.config.final_logit_softcapping = 30.0  # read by the packed pass; enough to take the soft-capped path
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9])]
    with pytest.warns(UserWarning, match="train.keep_logits has no effect"):
        out = packing.packed_forward_logprobs(model, seqs, attn="native", keep_logits=True)
    out.logprobs.sum().backward()

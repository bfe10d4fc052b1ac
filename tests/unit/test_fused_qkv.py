"""cohort.fused_qkv: one q/k/v GEMM in the packed training forward equals the model's own three projections
(logprobs, entropy and every parameter's gradient), on each supported family, shared-prompt rows included;
other calls and other modules keep their own forward."""

from __future__ import annotations

import pytest
import torch
from tests.integration.engine_models import VOCAB, tiny_model

from cohort import fused_qkv
from cohort.packing import packed_forward_logprobs

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen2_sliding", "qwen3_moe"]


def sequences(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 9)]
    out = []
    for i, n in enumerate((4, 7, 1, 6)):
        out.append((prompts[i % 2], torch.randint(3, VOCAB, (n,), generator=gen).tolist()))
    return out


def logprobs_and_grads(model, share_prompts: bool):
    model.zero_grad(set_to_none=True)
    packed = packed_forward_logprobs(model, sequences(), share_prompts=share_prompts)
    (packed.logprobs.sum() + 0.3 * packed.entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return packed.logprobs.detach(), packed.entropy.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("share_prompts", [False, True])
def test_fused_projections_equal_the_models_own(family, share_prompts):
    model = tiny_model(family)
    want = logprobs_and_grads(model, share_prompts)
    layers = len(model.model.layers)
    assert fused_qkv.fuse_qkv_projections(model) == layers
    assert fused_qkv.fuse_qkv_projections(model) == layers  # idempotent
    calls = []
    original = fused_qkv.F.linear

    def counting(x, weight, bias=None):
        calls.append(weight)
        return original(x, weight, bias)

    attns = [layer.self_attn for layer in model.model.layers]
    projections = {id(getattr(a, n).weight) for a in attns for n in ("q_proj", "k_proj", "v_proj")}
    qkv_rows = attns[0].q_proj.out_features + attns[0].k_proj.out_features + attns[0].v_proj.out_features
    fused_qkv.F.linear = counting  # torch.nn.functional.linear, which nn.Linear calls too
    try:
        got = logprobs_and_grads(model, share_prompts)
    finally:
        fused_qkv.F.linear = original
    # one GEMM per layer over the three concatenated weights, none over a projection's own weight
    fused = [w for w in calls if not isinstance(w, torch.nn.Parameter)]  # the concatenated weights
    assert [w.shape[0] for w in fused] == [qkv_rows] * layers
    assert not any(id(w) in projections for w in calls)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=1e-4, msg=name)


def test_ordinary_forward_and_generate_keep_the_models_own():
    model = tiny_model("qwen2")
    ids = torch.tensor([[5, 6, 7, 8]])
    want = model(ids).logits
    fused_qkv.fuse_qkv_projections(model)
    torch.testing.assert_close(model(ids).logits, want)
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_a_forward_that_disagrees_is_not_kept(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setattr(fused_qkv, "_sliding_window", lambda module: 2)  # a window the model does not have
    with pytest.warns(UserWarning, match="keep their own forward"):
        assert fused_qkv.fuse_qkv_projections(model) == 0
    assert all("forward" not in vars(layer.self_attn) for layer in model.model.layers)


def test_gemma3_and_lora_are_left_alone():
    assert fused_qkv.fuse_qkv_projections(tiny_model("gemma3")) == 0
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("qwen2"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert fused_qkv.fuse_qkv_projections(model) == 0

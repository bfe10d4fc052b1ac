"""The packed training forward on Mistral, Qwen2 with sliding layers, Gemma 3, Qwen3-MoE, Gemma 2 (attention-
logit soft-capping) and GPT-OSS (attention sinks): logprobs, entropy and gradients of one padding-free row equal
the unpacked HF forward of each sequence on its own (the model's own eager attention), with sequences longer
than the sliding window (so the window must hold inside each packed sequence); the sinks get their gradient."""

from __future__ import annotations

import pytest
import torch
from tests.integration.engine_models import VOCAB, WINDOW, tiny_model

from cohort.forward.packed_attention import disable_packed_attention
from cohort.forward.packing import packed_forward_logprobs

FAMILIES = ["mistral", "qwen2_sliding", "gemma3", "qwen3_moe", "gemma2", "gpt_oss"]


def _sequences():
    g = torch.Generator().manual_seed(5)
    lens = [(5, 7), (3, 1), (9, 12), (1, 4), (16, 9), (2, 0)]  # up to 25 tokens, window 7

    def ids(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    return [(ids(p), ids(c)) for p, c in lens]


def _unpacked(model, sequences, temperature):
    """Each sequence alone through the HF model (its own masks, logit soft-capping included)."""
    out = []
    for prompt, completion in sequences:
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        logp = torch.log_softmax(logits.float() / temperature, -1)
        chosen = logp.gather(-1, torch.tensor(completion, dtype=torch.long)[:, None])[:, 0]
        out.append((chosen, -(logp.exp() * logp).sum(-1)))
    return out


def _loss(pairs, weights):
    return sum((lp * w).sum() + 0.1 * ent.sum() for (lp, ent), w in zip(pairs, weights))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["varlen", "native"])
def test_packed_equals_unpacked_hf_forward(family, attn):
    if family == "gpt_oss" and attn == "native":
        pytest.skip("transformers' GPT-OSS builds no block-diagonal mask from restarting position ids (its second "
                    "packed sequence attends to the first); cohort's packed forwards use attn='varlen'")
    model = tiny_model(family)
    if family == "gemma3":
        assert model.config.final_logit_softcapping is not None  # the soft-capped logprob path is covered
    seqs = _sequences()
    assert max(len(p) + len(c) for p, c in seqs) > 3 * WINDOW
    temperature = 0.8
    weights = [torch.linspace(-1, 1, len(c)) for _, c in seqs]
    try:
        packed = packed_forward_logprobs(model, seqs, temperature=temperature, chunk_tokens=5, attn=attn)
        _loss(packed.split(), weights).backward()
    finally:
        disable_packed_attention(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if family == "gpt_oss":
        assert any(n.endswith("sinks") and g.abs().sum() > 0 for n, g in grads.items())
    model.zero_grad(set_to_none=True)
    ref = _unpacked(model, seqs, temperature)
    _loss(ref, weights).backward()
    for (lp, ent), (rlp, rent) in zip(packed.split(), ref):
        assert torch.allclose(lp, rlp, atol=1e-5), (lp, rlp)
        assert torch.allclose(ent, rent, atol=1e-5)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(grads[name], p.grad, atol=1e-4, rtol=1e-4), name


def test_packed_window_matters():
    """Guard: the packed forward without the window differs from HF on sequences longer than it."""
    model = tiny_model("mistral")
    seqs = _sequences()
    with torch.no_grad():
        ref = _unpacked(model, seqs, 1.0)
        model.config.sliding_window = None  # the attention modules read the config: no window anywhere
        packed = packed_forward_logprobs(model, seqs, attn="varlen")
    disable_packed_attention(model)
    long = [i for i, (p, c) in enumerate(seqs) if len(p) + len(c) > WINDOW + 1 and c]
    assert any(not torch.allclose(packed.split()[i][0], ref[i][0], atol=1e-4) for i in long)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_unpacked_calls_keep_the_models_own_eager_attention(family):
    """After packing is enabled, ordinary forwards (generate, reference passes) go to the model's own eager
    attention, soft-capping and sinks included, not to sdpa (which has neither)."""
    from cohort.forward.packed_attention import enable_packed_attention

    model = tiny_model(family)
    ids = torch.tensor([_sequences()[4][0]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        enable_packed_attention(model)
        try:
            after = model(input_ids=ids).logits
        finally:
            disable_packed_attention(model)
    assert torch.allclose(before, after, atol=1e-6)

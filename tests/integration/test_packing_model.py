"""Packed (padding-free) logprobs and gradients equal the ordinary padded batch on tiny Llama and Qwen2."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from cohort.forward.packed_attention import disable_packed_attention
from cohort.forward.packing import compile_decoder_layers, packed_forward_logprobs

VOCAB = 97


def _tiny(arch):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, attn_implementation="sdpa"))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True, attn_implementation="sdpa"))
    return model.float().eval()


def _sequences():
    g = torch.Generator().manual_seed(3)
    lens = [(5, 7), (3, 1), (9, 12), (1, 4), (6, 0), (2, 9)]
    def ids(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    return [(ids(p), ids(c)) for p, c in lens]


def _padded_reference(model, sequences, temperature):
    """Right-padded batch with an attention mask and full logits: what TRL computes."""
    full = [p + c for p, c in sequences]
    t = max(map(len, full))
    ids = torch.zeros(len(full), t, dtype=torch.long)
    mask = torch.zeros(len(full), t, dtype=torch.long)
    for i, s in enumerate(full):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
    logp = torch.log_softmax(logits, -1)
    out = []
    for i, (p, c) in enumerate(sequences):
        rows = logp[i, len(p) - 1 : len(p) - 1 + len(c)]
        chosen = rows.gather(-1, torch.tensor(c, dtype=torch.long).unsqueeze(-1)).squeeze(-1)
        out.append((chosen, -(rows.exp() * rows).sum(-1)))
    return out


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["varlen", "native", "varlen+checkpointing"])
def test_packed_equals_padded(arch, attn, monkeypatch):
    import cohort.forward.packed_attention as packed_attention

    calls = []
    real = packed_attention._segment_sdpa
    monkeypatch.setattr(packed_attention, "_segment_sdpa", lambda *a: calls.append(1) or real(*a))
    model = _tiny(arch)
    if attn.endswith("checkpointing"):
        # Recomputation in backward must use the same (packed) attention as the forward did.
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
    seqs = _sequences()
    temperature = 0.8
    kernel = attn.split("+")[0]
    packed = packed_forward_logprobs(model, seqs, temperature=temperature, chunk_tokens=5, attn=kernel)
    weights = [torch.linspace(-1, 1, len(c)) for _, c in seqs]
    loss = sum((lp * w).sum() + 0.1 * ent.sum() for (lp, ent), w in zip(packed.split(), weights))
    loss.backward()
    g_packed = _grads(model)
    model.zero_grad(set_to_none=True)
    ref = _padded_reference(model, seqs, temperature)
    loss_ref = sum((lp * w).sum() + 0.1 * ent.sum() for (lp, ent), w in zip(ref, weights))
    loss_ref.backward()
    g_ref = _grads(model)
    for (lp, ent), (lp_r, ent_r) in zip(packed.split(), ref):
        torch.testing.assert_close(lp, lp_r, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ent, ent_r, rtol=1e-4, atol=1e-5)
    assert g_packed.keys() == g_ref.keys() and len(g_ref) > 5
    for name in g_ref:
        torch.testing.assert_close(g_packed[name], g_ref[name], rtol=1e-3, atol=1e-5, msg=name)
    assert float(loss_ref.detach()) != 0.0
    # One call per layer on the CPU varlen path (and one more per layer when checkpointing recomputes).
    assert len(calls) == {"varlen": 2, "native": 0, "varlen+checkpointing": 4}[attn]


def test_padded_layout_and_no_grad_mode():
    model = _tiny("llama")
    seqs = _sequences()
    with torch.no_grad():
        packed = packed_forward_logprobs(model, seqs, compute_entropy=False)
    assert packed.entropy is None
    assert packed.offsets == [0, 7, 8, 20, 24, 24, 33]
    pad = packed.padded()
    assert pad.shape == (6, 12)
    assert torch.equal(pad[1, 1:], torch.zeros(11)) and pad[1, 0] == packed.logprobs[7]
    assert (packed.logprobs < 0).all()
    # Ordinary (padded, masked) forwards after a packed one still use the model's own attention.
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
        disable_packed_attention(model)
        assert model.config._attn_implementation == "sdpa"
        before = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(after, before)


def test_rejects_empty_prompt():
    with pytest.raises(ValueError, match="empty prompt"):
        packed_forward_logprobs(_tiny("llama"), [([], [1, 2])])


def test_compile_decoder_layers_is_idempotent(monkeypatch):
    # The real compile runs in tests/gpu; here only which modules get compiled, and only once.
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compiled.append((type(self).__name__, kw)))
    model = _tiny("qwen2")
    assert compile_decoder_layers(model) == 2
    assert compile_decoder_layers(model) == 0
    assert compiled == [("Qwen2DecoderLayer", {"dynamic": True})] * 2


def test_packed_forward_skips_transformers_packed_sequence_search():
    """Inside a varlen packed forward transformers' search for packed sequences in the position ids answers
    None (its `.all()` is a host-device sync, and the mask it feeds is never built); elsewhere it is unchanged,
    so the 'native' packed path (a block-diagonal mask from the position ids) still gets its sequence ids."""
    from transformers import masking_utils

    from cohort.forward.packed_attention import _PACKED_MASKS

    model = _tiny("qwen2")
    packed_forward_logprobs(model, _sequences(), attn="varlen")  # installs the wrapper
    search = masking_utils.find_packed_sequence_indices
    assert getattr(search, "_cohort_wrapped", False)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert search(positions).tolist() == [[0, 0, 0, 1, 1, 2]]
    token = _PACKED_MASKS.set(True)
    try:
        assert search(positions) is None
    finally:
        _PACKED_MASKS.reset(token)
    packed_forward_logprobs(model, _sequences(), attn="varlen")  # idempotent: wrapped once
    assert masking_utils.find_packed_sequence_indices is search

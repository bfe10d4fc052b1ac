"""Shared-prompt rows (cohort.forward.shared_prompts): the layout worked out by hand, the grouped micro-batch planner,
and the packed forward on every family equal to the plain row (logprobs, entropy, gradients), sliding windows
and soft-capping included."""

from __future__ import annotations

import pytest
import torch
from tests.integration.engine_models import VOCAB, WINDOW, tiny_model

from cohort.forward.micro_batches import split_grouped_micro_batches
from cohort.forward.packed_attention import disable_packed_attention
from cohort.forward.packing import packed_forward_logprobs
from cohort.forward.shared_prompts import pack_shared_layout, prompt_groups


def layout_tokens(prompt_lens, completion_lens, groups) -> int:
    """Tokens of a shared row: each group's prompt once plus every completion (a lone sequence is a group)."""
    return sum(prompt_lens[g[0]] + sum(completion_lens[i] for i in g) for g in groups)


def test_layout_by_hand():
    p, a, b = [1, 2, 3], [4, 5], [6, 7, 8]
    q, r = [9, 10], [11]
    layout = pack_shared_layout([(p, a), (q, r), (list(p), b)])  # a different list with the same tokens
    assert layout is not None
    # row [p a b | q r]: the prompt once, then its completions; (q, r) alone as the plain segment
    assert layout.ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2]
    assert layout.cu_q.tolist() == [0, 3, 5, 8, 11]
    # keys: p; p + a; p + b; q r
    assert layout.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert layout.cu_k.tolist() == [0, 3, 8, 14, 17]
    # labels and their predicting rows in input order: a (first from p's last row 2), r, then b
    assert layout.labels.tolist() == [4, 5, 11, 6, 7, 8]
    assert layout.hidden_idx.tolist() == [2, 3, 9, 2, 5, 6]
    assert layout.offsets == [0, 2, 3, 6]
    assert (layout.max_q, layout.max_k) == (3, 6)
    assert layout_tokens([3, 2, 3], [2, 1, 3], prompt_groups([p, q, p])) == 11


def test_layout_edge_cases():
    assert pack_shared_layout([([1, 2], [3]), ([4], [5])]) is None  # no prompt repeats: the plain row
    # an empty completion of a shared prompt gets no segment (and no labels)
    layout = pack_shared_layout([([1, 2], [3]), ([1, 2], []), ([1, 2], [4, 5])])
    assert layout is not None
    assert layout.ids.tolist() == [1, 2, 3, 4, 5] and layout.cu_q.tolist() == [0, 2, 3, 5]
    assert layout.hidden_idx.tolist() == [1, 1, 3] and layout.offsets == [0, 1, 1, 3]
    with pytest.raises(ValueError, match="empty prompt"):
        pack_shared_layout([([], [3]), ([], [4])])


def test_prompt_groups_order_and_keys():
    prompts = [[5, 6], torch.tensor([7]), [5, 6], (7,), [5]]
    assert prompt_groups(prompts) == [[0, 2], [1, 3], [4]]


def test_grouped_micro_batches_keep_groups_and_fit():
    # 3 prompts of 10 tokens with 4 completions of 20: a group costs 10 + 80 = 90 tokens
    groups = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    prompt_lens, completion_lens = [10] * 12, [20] * 12
    bins = split_grouped_micro_batches(groups, prompt_lens, completion_lens, 200)
    assert sorted(i for b in bins for i in b) == list(range(12))
    for b in bins:
        assert layout_tokens(prompt_lens, completion_lens, prompt_groups([groups_of(i, groups) for i in b])) <= 200
        assert all(set(g) <= set(b) or not set(g) & set(b) for g in groups)  # a group never split
    assert len(bins) == 2
    # a group over the budget is cut into runs that each pay for the prompt: 10 + 2 x 20 = 50 <= 55
    bins = split_grouped_micro_batches([[0, 1, 2, 3]], [10] * 4, [20] * 4, 55)
    assert bins == [[0, 1], [2, 3]]
    # a member that cannot fit even alone sits alone
    assert split_grouped_micro_batches([[0, 1]], [10, 10], [100, 5], 50) == [[0], [1]]
    with pytest.raises(ValueError, match="token_budget"):
        split_grouped_micro_batches([[0]], [1], [1], 0)


def groups_of(i, groups):
    """A stand-in prompt for sequence i: its group's number (same group, same prompt)."""
    return [next(n for n, g in enumerate(groups) if i in g)]


def _group_sequences(seed=3):
    """Three prompts with 3, 1 and 4 completions (one empty), interleaved; up to 25 tokens (window 7)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    p1, p2, p3 = ids(9), ids(4), ids(1)
    spec = [(p1, 7), (p3, 3), (p2, 5), (p1, 12), (p3, 0), (p1, 1), (p3, 16), (p3, 2)]
    return [(list(p), ids(c)) for p, c in spec]


def _run(model, seqs, share, weights, temperature=0.8):
    try:
        packed = packed_forward_logprobs(model, seqs, temperature=temperature, chunk_tokens=5,
                                         share_prompts=share)
        loss = sum((lp * w).sum() + 0.1 * ent.sum() for (lp, ent), w in zip(packed.split(), weights))
        loss.backward()
    finally:
        disable_packed_attention(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [(lp.detach(), ent.detach()) for lp, ent in packed.split()], grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen2_sliding", "gemma3", "qwen3_moe"])
def test_shared_row_equals_plain_row(family, monkeypatch):
    """The shared layout gives the plain row's logprobs, entropy and gradients, windows longer and shorter
    than the prompt included; and it really is the layout that ran (fewer tokens through the model)."""
    model = tiny_model(family)
    seqs = _group_sequences()
    weights = [torch.linspace(-1, 1, len(c)) for _, c in seqs]
    plain, plain_grads = _run(model, seqs, False, weights)
    from cohort.forward import packing

    rows = []
    real = packing.packed_pass
    monkeypatch.setattr(packing, "packed_pass", lambda m, ids, *a, **k: rows.append(ids.shape[1]) or real(m, ids, *a, **k))
    shared, shared_grads = _run(model, seqs, True, weights)
    assert rows == [sum(len(c) for _, c in seqs) + 9 + 4 + 1]  # every prompt once
    for (lp, ent), (rlp, rent) in zip(shared, plain, strict=True):
        torch.testing.assert_close(lp, rlp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, rent, atol=1e-5, rtol=1e-5)
    assert shared_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)
    if family in ("mistral", "qwen2_sliding"):
        assert max(len(p) + len(c) for p, c in seqs) > 2 * WINDOW  # the window cuts into the prompt


def test_shared_row_is_not_the_plain_row_without_prompt_keys(monkeypatch):
    """Guard: completions that did not see their prompt's keys would give other logprobs."""
    from cohort.forward import packed_attention

    model = tiny_model("llama")
    seqs = _group_sequences()
    with torch.no_grad():
        plain = packed_forward_logprobs(model, seqs, share_prompts=False).split()
        real = packed_attention.varlen_attention_forward

        def own_keys_only(module, q, k, v, mask, **kwargs):
            kwargs.pop("cohort_kv_index", None)
            kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_q"]
            return real(module, q, k, v, mask, **kwargs)

        monkeypatch.setattr(packed_attention, "varlen_attention_forward", own_keys_only)
        from transformers import AttentionInterface

        AttentionInterface.register(packed_attention.VARLEN_IMPL, own_keys_only)
        try:
            broken = packed_forward_logprobs(model, seqs, share_prompts=True).split()
        finally:
            AttentionInterface.register(packed_attention.VARLEN_IMPL, real)
            disable_packed_attention(model)
    assert any(not torch.allclose(a[0], b[0], atol=1e-4) for a, b in zip(plain, broken) if len(a[0]) > 1)


def test_native_attention_keeps_the_plain_row():
    """attn="native" (the model's own masks) cannot read the layout: the plain row runs, with equal results."""
    model = tiny_model("llama")
    seqs = _group_sequences()
    with torch.no_grad():
        a = packed_forward_logprobs(model, seqs, attn="native", share_prompts=True).split()
        b = packed_forward_logprobs(model, seqs, attn="native", share_prompts=False).split()
    for (x, _), (y, _) in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)


def test_models_with_their_own_flash_packing_keep_the_plain_row_and_say_so():
    """A model loaded with a flash-attention implementation reads cu_seq_lens itself and would not gather a
    completion's prompt keys: the plain row is used, with one warning naming the fix."""
    import types
    import warnings

    from cohort.forward import packing

    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation="flash_attention_2"))
    with pytest.warns(UserWarning, match="model.attn_implementation=sdpa"):
        assert not packing._routes_varlen(model, "varlen")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        assert not packing._routes_varlen(model, "varlen")
    assert not packing._routes_varlen(model, "native")

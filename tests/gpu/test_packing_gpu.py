"""CUDA checks of the packed forward (flash varlen path), the chunked logprob kernel's memory, and HF generate."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from transformers import Qwen2Config, Qwen2ForCausalLM

import cohort.forward.packed_attention as packed_attention
import cohort.forward.packing as packing
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.forward.logprobs import selective_logprobs_and_entropy
from cohort.types import SamplingParams

VOCAB = 1000


def _model(dtype):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True,
                      attn_implementation="sdpa", eos_token_id=0, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).to("cuda", dtype)


def _sequences():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(1, VOCAB, (p,), generator=g).tolist(), torch.randint(1, VOCAB, (c,), generator=g).tolist())
            for p, c in [(17, 40), (5, 3), (64, 130), (9, 1), (33, 77)]]


def _run(model, seqs, attn="varlen", share=False):
    model.zero_grad(set_to_none=True)
    out = packing.packed_forward_logprobs(model, seqs, temperature=0.9, chunk_tokens=64, attn=attn,
                                          share_prompts=share)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return out.logprobs.detach(), grads


def test_flash_varlen_matches_masked_sdpa_bf16(monkeypatch):
    calls = []
    real = packed_attention._flash_varlen
    monkeypatch.setattr(packed_attention, "_flash_varlen", lambda *a: calls.append(1) or real(*a))
    model, seqs = _model(torch.bfloat16), _sequences()
    lp_v, g_v = _run(model, seqs, "varlen")
    assert len(calls) == 2  # one per layer: the flash kernel ran
    lp_n, g_n = _run(model, seqs, "native")
    assert (lp_v - lp_n).abs().max().item() < 5e-2
    assert torch.nn.functional.cosine_similarity(g_v, g_n, dim=0).item() > 0.999


def test_grouped_kv_heads_equal_expanded_heads(monkeypatch):
    """Where torch's varlen kernel takes grouped KV heads (prepare_flash's check), the packed forward hands them
    over as they are: logprobs and every gradient equal the run that expands the KV heads first."""
    model, seqs = _model(torch.bfloat16), _sequences()
    packing.prepare_flash(torch.device("cuda"))
    assert packed_attention.GROUPED_KV["native"] is not None  # decided on the first CUDA packed forward
    decided = packed_attention.GROUPED_KV["native"]
    for context in (torch.no_grad, torch.inference_mode):  # the first call may come there: the same answer
        monkeypatch.setitem(packed_attention.GROUPED_KV, "native", None)
        with context():
            packing.prepare_flash(torch.device("cuda"))
        assert packed_attention.GROUPED_KV["native"] == decided
    if not packed_attention.GROUPED_KV["native"]:
        pytest.skip("this torch's varlen attention expands KV heads")
    for share in (False, True):
        lp_grouped, g_grouped = _run(model, seqs, share=share)
        monkeypatch.setitem(packed_attention.GROUPED_KV, "native", False)
        lp_expanded, g_expanded = _run(model, seqs, share=share)
        monkeypatch.setitem(packed_attention.GROUPED_KV, "native", True)
        torch.testing.assert_close(lp_grouped, lp_expanded, atol=2e-2, rtol=0)
        assert torch.nn.functional.cosine_similarity(g_grouped, g_expanded, dim=0).item() > 0.9999


def _fa4_importable() -> bool:
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.skipif(not _fa4_importable(), reason="needs flash-attn-4 (flash_attn.cute): pip install flash-attn-4")
@pytest.mark.parametrize("compiled", [False, True])
def test_fa4_kernel_matches_masked_sdpa_bf16(monkeypatch, compiled):
    """model.packed_attention=fa4: FlashAttention-4 runs once per layer (eager, and inside compiled layers,
    where it stays out of the graph) and gives the masked-SDPA logprobs and gradients."""
    calls = []
    real = packed_attention._fa4_varlen
    monkeypatch.setattr(packed_attention, "_fa4_varlen", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setitem(packed_attention._KERNEL, "name", "fa4")
    model, seqs = _model(torch.bfloat16), _sequences()
    if compiled:
        packing.compile_decoder_layers(model)
    lp_v, g_v = _run(model, seqs, "varlen")
    assert len(calls) >= 2  # one per layer at least (a recompiled layer may call it again)
    lp_n, g_n = _run(model, seqs, "native")
    assert (lp_v - lp_n).abs().max().item() < 5e-2
    assert torch.nn.functional.cosine_similarity(g_v, g_n, dim=0).item() > 0.999


def _group_sequences():
    """Two prompts with 6 and 3 completions (lengths 1 to 150) and one prompt alone."""
    g = torch.Generator().manual_seed(2)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    p1, p2 = ids(48), ids(7)
    spec = [(p1, 150), (p2, 9), (p1, 1), (p1, 64), (ids(20), 33), (p2, 120), (p1, 17), (p1, 90), (p2, 2), (p1, 5)]
    return [(list(p), ids(c)) for p, c in spec]


@pytest.mark.parametrize("kernel", ["torch", "fa4"])
@pytest.mark.parametrize("compiled", [False, True])
def test_shared_prompts_match_plain_rows_bf16(monkeypatch, kernel, compiled):
    """train.share_prompts on the flash kernels: a completion's queries (shorter than its prompt + completion
    keys) are aligned to the end of the key segment, so the shared row gives the plain row's logprobs and
    gradients (a top-left alignment would hide most of each completion from itself)."""
    if kernel == "fa4" and not _fa4_importable():
        pytest.skip("needs flash-attn-4 (flash_attn.cute)")
    monkeypatch.setitem(packed_attention._KERNEL, "name", kernel)
    calls = []
    name = "_fa4_varlen" if kernel == "fa4" else "_flash_varlen"
    real = getattr(packed_attention, name)
    # (q, k, v, cu_q, cu_k, max_q, max_k, ...): a shared row's longest key segment is a prompt + completion
    monkeypatch.setattr(packed_attention, name, lambda *a: calls.append(a[6] != a[5]) or real(*a))
    model, seqs = _model(torch.bfloat16), _group_sequences()
    if compiled:
        packing.compile_decoder_layers(model)
    lp_p, g_p = _run(model, seqs, share=False)
    assert calls and not any(calls)  # plain rows: the key segments are the query segments
    calls.clear()
    lp_s, g_s = _run(model, seqs, share=True)
    assert calls and all(calls)  # the shared layout reached the kernel
    assert (lp_s - lp_p).abs().max().item() < 5e-2
    assert torch.nn.functional.cosine_similarity(g_s, g_p, dim=0).item() > 0.999


def test_compiled_layers_match_eager():
    model, seqs = _model(torch.bfloat16), _sequences()
    lp_e, g_e = _run(model, seqs, "varlen")
    assert packing.compile_decoder_layers(model) == 2
    assert packing.compile_decoder_layers(model) == 0  # idempotent
    lp_c, g_c = _run(model, seqs, "varlen")
    assert (lp_c - lp_e).abs().max().item() < 5e-2
    assert torch.nn.functional.cosine_similarity(g_c, g_e, dim=0).item() > 0.999


def test_fp32_cuda_segment_path_exact():
    model, seqs = _model(torch.float32), _sequences()
    lp_v, g_v = _run(model, seqs, "varlen")
    lp_n, g_n = _run(model, seqs, "native")
    torch.testing.assert_close(lp_v, lp_n, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g_v, g_n, rtol=1e-3, atol=1e-4)


def test_chunked_logprobs_memory_does_not_grow_with_tokens():
    n, d, v, chunk = 16384, 256, 32000, 1024
    h = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = selective_logprobs_and_entropy(h, w, labels, chunk_tokens=chunk)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_logits = n * v * 4  # 2 GB of fp32 logits never exist
    grads_and_outputs = h.numel() * 2 + w.numel() * (2 + 4) + n * 8
    # At most a few [chunk, vocab] fp32 buffers alive at once (logits, softmax, gradient, the bf16 cast).
    bound = grads_and_outputs + 5 * chunk * v * 4
    print(f"peak extra {extra / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB, full logits {full_logits / 2**20:.0f} MiB")
    assert extra < bound < full_logits / 2


def test_hf_generate_logprobs_on_cuda():
    model = _model(torch.bfloat16)

    class Tok:  # generate only needs ids here (no stop strings)
        pad_token_id, eos_token_id = 0, 0

    prompts = [s[0] for s in _sequences()]
    out = HFGenerateEngine(model, Tok()).generate(prompts, SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=0))
    seqs = [(p, c.token_ids) for p, g in zip(prompts, out) for c in g]
    with torch.no_grad():
        ref = packing.packed_forward_logprobs(model, seqs, compute_entropy=False)
    got = torch.tensor([x for g in out for c in g for x in c.logprobs], device="cuda")
    assert (got - ref.logprobs).abs().mean().item() < 5e-2  # bf16: padded decode vs packed prefill


def test_one_pass_logprob_statistics_match_eager_on_cuda():
    from cohort.forward import triton_logprobs
    from cohort.forward.logprobs import _stats_eager

    torch.manual_seed(0)
    logits = (torch.randn(512, 151936, device="cuda") * 4).to(torch.bfloat16)
    logits[7] *= 30  # peaked row
    labels = torch.randint(0, 151936, (512,), device="cuda")
    for inv_t in (1.0, 1 / 0.7):
        got = triton_logprobs.stats(logits, labels, inv_t, True)
        want = _stats_eager(logits, labels, inv_t, True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)


def test_chunked_logprobs_and_grads_on_cuda_match_float64():
    from cohort.forward.logprobs import selective_logprobs_and_entropy

    torch.manual_seed(0)
    hidden = torch.randn(300, 64, device="cuda", dtype=torch.float32, requires_grad=True)
    weight = torch.randn(1000, 64, device="cuda", dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 1000, (300,), device="cuda")
    lp, ent = selective_logprobs_and_entropy(hidden, weight, labels, temperature=0.8, chunk_tokens=128)
    (lp.sum() + 0.3 * ent.sum()).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t() / 0.8, dim=-1)
    ref_lp = logp.gather(-1, labels[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref_lp.sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-3, rtol=2e-3)  # TF32 matmuls, if a test enabled them
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(hidden.grad.double(), h64.grad, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(weight.grad.double(), w64.grad, atol=5e-3, rtol=5e-3)

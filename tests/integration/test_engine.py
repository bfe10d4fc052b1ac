"""CohortEngine on tiny float32 models on the CPU: equality with HF generate, group sharing, preemption,
logprobs equal to the trainer's recompute, seeds, stops."""

from __future__ import annotations

import math

import pytest
import torch
from tests.integration.engine_models import EOS, hf_greedy, random_prompts, recomputed_logprobs, tiny_model

from cohort.engine import CohortEngine, engine_supports
from cohort.types import RolloutEngine, SamplingParams

MIXED = [5, 11, 2, 17, 8]


def make_engine(model, **kw) -> CohortEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    return CohortEngine(model, eos_token_ids=[EOS], **kw)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_hf_generate_on_mixed_lengths(family):
    model = tiny_model(family)
    prompts = random_prompts(MIXED)
    engine = make_engine(model)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    expected = hf_greedy(model, prompts, 20)
    got = [group[0].token_ids for group in out]
    assert got == expected
    for group, ref in zip(out, expected):
        assert group[0].finish_reason == ("stop" if ref[-1] == EOS else "length")
        assert len(group[0].logprobs) == len(group[0].token_ids)


def test_group_shares_prompt_blocks_and_prefills_once():
    model = tiny_model("llama")
    prompt = random_prompts([10])[0]  # 10 tokens at block_size 4: 2 full blocks + 1 partial
    engine = make_engine(model)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    engine._add(0, prompt, params)
    engine.step()  # the prefill step
    assert engine.stats.prefill_tokens == 10  # the prompt once, not 4 times
    used = engine.blocks.num_used_blocks
    assert used == 3 + 3  # the prompt's 3 blocks + a private copy of the partial block for 3 followers
    seqs = list(engine.scheduler.running)
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert [engine.blocks.ref_counts[b] for b in shared] == [4, 4]
    assert len({s.block_table[2] for s in seqs}) == 4  # each sample owns its partial block
    while engine.scheduler.has_work():
        engine.step()
    assert engine.blocks.num_used_blocks == 0  # everything returned to the pool


def test_sharing_does_not_change_samples():
    """n=4 on one prompt (shared blocks) equals four copies of the prompt with n=1 (same seeds by contract)."""
    model = tiny_model("qwen2")
    prompt = random_prompts([10])[0]
    params = SamplingParams(n=4, temperature=0.9, max_tokens=12, seed=11)
    grouped = make_engine(model).generate([prompt], params)[0]
    single = make_engine(model).generate([prompt] * 4, SamplingParams(n=1, temperature=0.9, max_tokens=12, seed=11))
    assert [c.token_ids for c in grouped] == [g[0].token_ids for g in single]
    for a, b in zip(grouped, single):
        assert a.logprobs == pytest.approx(b[0].logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in grouped}) > 1  # different seeds, different samples


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_and_resumption_give_the_same_tokens(temperature):
    model = tiny_model("llama")
    prompts = random_prompts([6, 9, 3, 12])
    params = SamplingParams(n=2, temperature=temperature, max_tokens=24, seed=5, ignore_eos=True)
    roomy = make_engine(model).generate(prompts, params)
    tight = make_engine(model, num_kv_blocks=12)  # 48 token slots for 8 sequences of up to 36 tokens
    cramped = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in g] for g in cramped] == [[c.token_ids for c in g] for g in roomy]
    for g1, g2 in zip(cramped, roomy):
        for c1, c2 in zip(g1, g2):
            assert c1.logprobs == pytest.approx(c2.logprobs, abs=1e-4)
    assert tight.blocks.num_used_blocks == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sampled_logprobs_equal_trainer_recompute(family):
    model = tiny_model(family)
    prompts = random_prompts([4, 13])
    temperature = 0.7
    out = make_engine(model).generate(prompts, SamplingParams(n=3, temperature=temperature, max_tokens=15, seed=0))
    for prompt, group in zip(prompts, out):
        for completion in group:
            ref = recomputed_logprobs(model, prompt, completion.token_ids, temperature)
            assert completion.logprobs == pytest.approx(ref, abs=2e-5)


def test_greedy_logprobs_are_at_temperature_one():
    model = tiny_model("llama")
    prompt = random_prompts([7])[0]
    completion = make_engine(model).generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0][0]
    ref = recomputed_logprobs(model, prompt, completion.token_ids, 1.0)
    assert completion.logprobs == pytest.approx(ref, abs=2e-5)


def test_same_seed_reproduces_and_other_seed_differs():
    model = tiny_model("llama")
    prompts = random_prompts([5, 8])
    engine = make_engine(model)
    a = engine.generate(prompts, SamplingParams(n=2, max_tokens=16, seed=42, ignore_eos=True))
    b = engine.generate(prompts, SamplingParams(n=2, max_tokens=16, seed=42, ignore_eos=True))
    c = engine.generate(prompts, SamplingParams(n=2, max_tokens=16, seed=43, ignore_eos=True))
    tokens = [[x.token_ids for x in g] for g in a]
    assert tokens == [[x.token_ids for x in g] for g in b]
    assert tokens != [[x.token_ids for x in g] for g in c]


def test_released_kv_cache_comes_back_for_the_next_generate():
    """generation.release_kv_during_update: the pool is freed between calls and re-allocated by generate."""
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 8])
    params = SamplingParams(n=2, max_tokens=12, seed=7, ignore_eos=True)
    engine = make_engine(model)
    first = engine.generate(prompts, params)
    engine.release_kv_cache()
    assert engine.runner.kv_cache is None
    again = engine.generate(prompts, params)
    assert engine.runner.kv_cache is not None
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert [[c.logprobs for c in g] for g in first] == [[c.logprobs for c in g] for g in again]


def test_top_k_one_equals_greedy():
    model = tiny_model("qwen3")
    prompts = random_prompts(MIXED)
    engine = make_engine(model)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    top1 = engine.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=12, seed=9))
    assert [g[0].token_ids for g in top1] == [g[0].token_ids for g in greedy]
    # The reported logprob stays log_softmax(logits / T) of the raw logits: below 0, unlike top-1's 0.
    assert all(lp < 0 for g in top1 for lp in g[0].logprobs)


def test_stops_max_tokens_and_ignore_eos():
    model = tiny_model("llama")
    prompts = random_prompts([6])
    engine = make_engine(model)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0][0]
    assert len(free.token_ids) == 30 and free.finish_reason == "length"
    stop_token = free.token_ids[4]
    first = free.token_ids.index(stop_token)
    stopped = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                      stop_token_ids=(stop_token,)))[0][0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


class _DigitTokenizer:
    """Decodes token t to chr(ord('a') + t % 26): enough to test stop strings."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings_end_the_completion():
    model = tiny_model("llama")
    prompts = random_prompts([6])
    base = make_engine(model).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = _DigitTokenizer().decode(base[0][0].token_ids)
    target = text[5:7]
    cut = text.index(target) + len(target)  # characters == tokens for this tokenizer
    engine = CohortEngine(model, _DigitTokenizer(), eos_token_ids=[EOS], block_size=4, max_model_len=128)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                  stop_strings=(target,)))[0][0]
    assert out.token_ids == base[0][0].token_ids[:cut] and out.finish_reason == "stop"


def test_per_prompt_params_and_validation():
    model = tiny_model("llama")
    prompts = random_prompts([3, 4])
    engine = make_engine(model)
    out = engine.generate(prompts, [SamplingParams(max_tokens=3, ignore_eos=True, seed=1),
                                    SamplingParams(max_tokens=7, ignore_eos=True, seed=1)])
    assert [len(g[0].token_ids) for g in out] == [3, 7]
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 10], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())


def test_engine_supports_rejects_other_architectures():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    ok, reason = engine_supports(gpt2)
    assert not ok and "gpt2" in reason
    assert engine_supports(tiny_model("qwen3")) == (True, "ok")
    with pytest.raises(ValueError, match="gpt2"):
        CohortEngine(gpt2, eos_token_ids=[0])


def test_logprobs_are_finite_probabilities():
    model = tiny_model("qwen2")
    out = make_engine(model).generate(random_prompts([5]), SamplingParams(n=2, top_p=0.8, min_p=0.05,
                                                                          repetition_penalty=1.3, seed=2,
                                                                          max_tokens=10))
    assert all(math.isfinite(lp) and lp <= 0 for c in out[0] for lp in c.logprobs)


def test_fused_projection_copies_match_and_refresh_after_an_update():
    model = tiny_model("qwen2")  # qkv bias
    prompts = random_prompts(MIXED)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    fused = make_engine(model, fuse_projections=True)
    assert fused.runner.net.fused
    assert [g[0].token_ids for g in fused.generate(prompts, params)] == hf_greedy(model, prompts, 10)
    with torch.no_grad():  # an "optimizer step"
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fused.sync_weights()
    assert [g[0].token_ids for g in fused.generate(prompts, params)] == hf_greedy(model, prompts, 10)


def test_lora_adapters_apply_without_merging():
    peft = pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")
    model = tiny_model("qwen3")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                             init_lora_weights=False)  # random A and B: the adapter changes the outputs
    lora = peft.get_peft_model(model, config).eval()
    prompts = random_prompts(MIXED)
    engine = make_engine(lora)
    assert not engine.runner.net.fused  # LoRA wrappers keep running their own forward
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    expected = hf_greedy(lora, prompts, 12)
    assert [g[0].token_ids for g in out] == expected
    with lora.disable_adapter():
        assert hf_greedy(lora, prompts, 12) != expected  # the adapter really matters here


def test_an_error_mid_generate_leaves_the_engine_clean():
    model = tiny_model("llama")
    engine = make_engine(model)
    prompts = random_prompts([5, 6])
    with pytest.raises(ValueError, match="max_model_len"):  # the second prompt is rejected after the first queued
        engine.generate([prompts[0], [1] * 120], SamplingParams(max_tokens=20))
    assert not engine.scheduler.has_work() and engine.blocks.num_used_blocks == 0
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [len(g) for g in out] == [1, 1] and len(out[0][0].token_ids) == 5

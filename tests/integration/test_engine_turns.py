"""Multi-turn generation (`generate_turns`) on tiny float32 models on the CPU: the paged engine continues a
conversation on its kept KV blocks and matches the HF reference, which re-runs generate on the whole
conversation every turn.

A scripted callback stands in for the tools: after turn 1 and turn 2 it appends fixed context tokens, after
turn 3 it ends the conversation. Turns end on a set of stop token ids that greedy decoding of the tiny model
reaches within a few tokens.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.integration.engine_models import EOS, random_prompts, recomputed_logprobs, tiny_model

from cohort.engine import CohortEngine
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.types import SamplingParams, TurnEnd

STOPS = tuple(range(3, 24))
CONTEXT = {1: [50, 51, 52, 53, 54], 2: [60, 61, 62]}  # what "the tools" append after turns 1 and 2


class _Tok:
    """What HFGenerateEngine needs of a tokenizer when no stop strings are used."""

    pad_token_id = 0
    eos_token_id = EOS


def scripted(turn: TurnEnd) -> list[int] | None:
    return CONTEXT.get(turn.turn)


def make_engine(model, **kw) -> CohortEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 160)
    return CohortEngine(model, eos_token_ids=[EOS], **kw)


def expected_mask(completion) -> list[int]:
    """1 on sampled tokens, 0 on the scripted context, rebuilt from the token stream and the script."""
    mask, ids, turn, k = [], completion.token_ids, 1, 0
    while k < len(ids):
        if ids[k] in STOPS or ids[k] == EOS:
            mask.append(1)
            k += 1
            context = CONTEXT.get(turn, [])
            assert ids[k : k + len(context)] == context
            mask += [0] * len(context)
            k += len(context)
            turn += 1
        else:
            mask.append(1)
            k += 1
    return mask


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_three_turns_match_hf_reference_and_prefill_only_new_tokens(family):
    model = tiny_model(family)
    prompts = random_prompts([7, 12, 5])
    params = SamplingParams(n=1, temperature=0.0, max_tokens=80, stop_token_ids=STOPS)
    engine = make_engine(model)
    got = engine.generate_turns(prompts, params, scripted)
    ref = HFGenerateEngine(model, _Tok(), eos_token_ids=[EOS]).generate_turns(prompts, params, scripted)
    for (c,), (r,) in zip(got, ref):
        assert c.turns == r.turns == 3
        assert c.token_ids == r.token_ids
        assert c.mask == r.mask == expected_mask(c)
        assert c.finish_reason == r.finish_reason == "stop"
        assert c.logprobs == pytest.approx(r.logprobs, abs=2e-5)
        assert [lp for lp, m in zip(c.logprobs, c.mask) if not m] == [0.0] * (len(c.mask) - sum(c.mask))
    # No re-prefill: each prompt once, then per continued turn the appended context plus the turn's last
    # sampled token (its KV is computed when the next turn starts; a single-turn generate never needs it).
    continued = sum(len(CONTEXT[1]) + 1 + len(CONTEXT[2]) + 1 for _ in prompts)
    assert engine.stats.prefill_tokens == sum(map(len, prompts)) + continued
    assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.paused


def test_sampled_turns_logprobs_equal_recompute_and_futures_give_the_same_result():
    model = tiny_model("qwen2")
    prompts = random_prompts([6, 9])
    params = SamplingParams(n=3, temperature=0.9, max_tokens=70, stop_token_ids=STOPS, seed=4)
    direct = make_engine(model).generate_turns(prompts, params, scripted)
    with ThreadPoolExecutor(2) as pool:  # replies resolved later, as tools on threads would
        deferred = make_engine(model).generate_turns(prompts, params, lambda t: pool.submit(scripted, t))
    for prompt, group, group2 in zip(prompts, direct, deferred):
        for c, c2 in zip(group, group2):
            assert c.token_ids == c2.token_ids and c.mask == c2.mask
            recomputed = recomputed_logprobs(model, prompt, c.token_ids, 0.9)
            sampled = [(a, b) for a, b, m in zip(c.logprobs, recomputed, c.mask) if m]
            assert [a for a, _ in sampled] == pytest.approx([b for _, b in sampled], abs=2e-5)
    assert any(c.turns == 3 for g in direct for c in g)


def test_tight_cache_evicts_paused_sequences_and_gives_the_same_tokens():
    model = tiny_model("llama")
    prompts = random_prompts([6, 9, 3, 12])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, stop_token_ids=STOPS, seed=5)

    def slow(pool):
        return lambda t: pool.submit(scripted, t)

    roomy = make_engine(model).generate_turns(prompts, params, scripted)
    tight = make_engine(model, num_kv_blocks=14)
    with ThreadPoolExecutor(1) as pool:
        cramped = tight.generate_turns(prompts, params, slow(pool))
    assert [[c.token_ids for c in g] for g in roomy] == [[c.token_ids for c in g] for g in cramped]
    assert [[c.mask for c in g] for g in roomy] == [[c.mask for c in g] for g in cramped]
    assert tight.scheduler.num_evictions + tight.scheduler.num_preemptions > 0
    assert tight.blocks.num_used_blocks == 0


def test_length_cap_covers_the_whole_conversation_and_overflow_is_an_error():
    model = tiny_model("llama")
    prompt = random_prompts([8])
    params = SamplingParams(n=1, temperature=0.0, max_tokens=12, stop_token_ids=STOPS)
    (c,), = make_engine(model).generate_turns(
        prompt, params, lambda t: [50] * 3 if len(t.completion_ids) + 3 < 12 else None)
    assert c.turns >= 2 and len(c.token_ids) <= 12
    engine = make_engine(model)
    with pytest.raises(ValueError, match="leaves no room"):
        engine.generate_turns(prompt, params, lambda t: [50] * 20)
    assert engine.blocks.num_used_blocks == 0  # the failed call left the engine clean
    assert engine.generate(prompt, params)[0][0].mask is None  # single-turn generate is unchanged


def test_continued_turns_wait_to_share_a_prefill_without_changing_any_token():
    """continuation_delay_steps holds continued turns for a few decode steps while others decode, so fewer
    prefill steps run; every sequence samples the same tokens and logprobs as with no delay (its noise comes
    from its seed and position, not the batch)."""
    model = tiny_model("llama")
    prompts = random_prompts([7, 12, 5, 9, 6, 11])
    params = SamplingParams(n=4, temperature=1.0, max_tokens=60, stop_token_ids=STOPS, seed=3)
    results, stats = {}, {}
    for delay in (0, 8):
        engine = make_engine(model, continuation_delay_steps=delay)
        results[delay] = engine.generate_turns(prompts, params, scripted)
        stats[delay] = engine.stats
        assert engine.blocks.num_used_blocks == 0 and not engine.scheduler.waiting
    for group0, group8 in zip(results[0], results[8]):
        for a, b in zip(group0, group8):
            assert a.token_ids == b.token_ids and a.mask == b.mask and a.turns == b.turns
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert sum(c.turns for g in results[8] for c in g) > len(prompts) * params.n  # turns were continued
    assert stats[8].prefill_steps < stats[0].prefill_steps
    assert stats[8].prefill_tokens == stats[0].prefill_tokens


def test_continuation_delay_steps_must_be_a_non_negative_integer():
    with pytest.raises(ValueError, match="continuation_delay_steps=-1"):
        make_engine(tiny_model("llama"), continuation_delay_steps=-1)

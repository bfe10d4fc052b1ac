"""Multi-step decode (EngineConfig.decode_steps = K): K decode steps per host iteration give exactly the tokens
and logprobs of one step per iteration, on tiny float32 models on the CPU.

On the CPU the K-step loop runs eagerly (the same device-side code a CUDA graph captures on the GPU: tokens
fed back, positions, context lengths and KV slots advanced on the device, rows past their budget writing to
the scratch block). Cases that stress it: EOS and stop tokens inside a chunk (the rest dropped), per-prompt
max_tokens that end inside a chunk, stop strings, preemption under a tight cache, group sharing, multi-turn
continuation on the same blocks, and chunks whose lookahead blocks do not fit (fallback to one step).
"""

from __future__ import annotations

import pytest
from tests.integration.engine_models import EOS, random_prompts, tiny_model
from tests.integration.test_engine_turns import CONTEXT, STOPS, scripted

from cohort.engine import CohortEngine
from cohort.types import SamplingParams


def make_engine(model, steps: int, **kw) -> CohortEngine:
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 160)
    return CohortEngine(model, eos_token_ids=[EOS], decode_steps=steps, **kw)


def spy_launches(engine) -> list[tuple[list[int], bool]]:
    """Record (budgets, chained) of every multi-step launch."""
    seen: list[tuple[list[int], bool]] = []
    launch = engine.runner.launch_multi

    def spy(seqs, budgets, chained=False):
        seen.append((list(budgets), chained))
        return launch(seqs, budgets, chained)

    engine.runner.launch_multi = spy
    return seen


def tokens(out):
    return [[c.token_ids for c in group] for group in out]


def assert_same(a, b):
    assert tokens(a) == tokens(b)
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga, gb):
            assert ca.finish_reason == cb.finish_reason
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-5)
            assert ca.mask == cb.mask


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_k_steps_equal_one_step_with_mixed_budgets_and_stops(family, temperature):
    model = tiny_model(family)
    prompts = random_prompts([5, 11, 2, 17, 8, 9])
    # max_tokens that end inside a chunk of 4, EOS allowed (stops land anywhere in a chunk)
    params = [SamplingParams(n=3, temperature=temperature, max_tokens=m, seed=7 + i)
              for i, m in enumerate([9, 13, 1, 22, 6, 30])]
    one = make_engine(model, 1)
    four = make_engine(model, 4)
    assert one.runner.decode_steps == 1 and four.runner.decode_steps == 4
    chunks = spy_launches(four)
    ref, got = one.generate(prompts, params), four.generate(prompts, params)
    assert chunks and any(min(b) < 4 for b, _ in chunks)  # K-step chunks ran, some with rows ending inside
    assert_same(got, ref)
    assert four.stats.decode_tokens == one.stats.decode_tokens
    assert four.stats.decode_steps >= one.stats.decode_steps
    assert four.blocks.num_used_blocks == 0
    lengths = {len(c.token_ids) for g in ref for c in g}
    assert len(lengths) > 3  # the budgets and stops really differ between rows


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chained_launches_run_ahead_of_the_host(temperature):
    """With no prefill waiting and full chunks, the next launch is queued before the host reads the current
    one (it continues from the device state); rows that stop inside a launch are computed once more in vain
    and dropped; results equal one step per iteration."""
    model = tiny_model("qwen2")
    prompts = random_prompts([5, 11, 7])
    for params in (SamplingParams(n=2, temperature=temperature, max_tokens=37, seed=4, ignore_eos=True),
                   SamplingParams(n=2, temperature=temperature, max_tokens=37, seed=4, stop_token_ids=(5, 9, 17))):
        engine = make_engine(model, 4)
        launches = spy_launches(engine)
        got = engine.generate(prompts, params)
        assert_same(got, make_engine(model, 1).generate(prompts, params))
        assert engine._inflight is None and engine.blocks.num_used_blocks == 0
        if params.ignore_eos:
            # 37 tokens: the prefill samples 1, then chunks of 4 (the first fresh, the rest chained), then 4
            assert [b for b, _ in launches] == [[4] * 6] * 9
            assert [c for _, c in launches] == [False] + [True] * 8
        else:
            assert any(c for _, c in launches)


def test_rows_that_end_stay_in_a_chained_batch_with_budget_zero():
    """Rows of different max_tokens end at different launches: the chain goes on while at least 3/4 of the
    rows decode, the ended ones riding along with a budget of 0; then a fresh launch drops them."""
    model = tiny_model("llama")
    prompts = random_prompts([6] * 8)
    params = [SamplingParams(temperature=1.0, max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate([41, 37, 30, 25, 41, 41, 41, 41])]
    engine = make_engine(model, 4)
    launches = spy_launches(engine)
    got = engine.generate(prompts, params)
    assert_same(got, make_engine(model, 1).generate(prompts, params))
    assert [len(c.token_ids) for g in got for c in g] == [41, 37, 30, 25, 41, 41, 41, 41]
    chained_with_ended_rows = [b for b, chained in launches if chained and 0 in b]
    assert chained_with_ended_rows and all(sum(x > 0 for x in b) >= 6 for b in chained_with_ended_rows)
    assert any(not chained and len(b) < 8 for b, chained in launches[1:])  # compacted by a fresh launch
    assert engine._inflight is None and engine.blocks.num_used_blocks == 0


def test_stop_tokens_inside_a_chunk_drop_the_rest():
    model = tiny_model("llama")
    prompts = random_prompts([6, 7])
    free = make_engine(model, 1).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    stop = free[0][0].token_ids[5]  # a token the first completion samples at index 5 (inside the 2nd chunk of 4)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop,))
    got = make_engine(model, 4).generate(prompts, params)
    assert_same(got, make_engine(model, 1).generate(prompts, params))
    first = free[0][0].token_ids.index(stop)
    assert got[0][0].token_ids == free[0][0].token_ids[: first + 1] and got[0][0].finish_reason == "stop"


class _LetterTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_stop_strings():
    model = tiny_model("llama")
    prompts = random_prompts([6])
    base = make_engine(model, 1).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    target = _LetterTokenizer().decode(base[0][0].token_ids)[6:8]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_strings=(target,))
    outs = [CohortEngine(model, _LetterTokenizer(), eos_token_ids=[EOS], block_size=4, max_model_len=128,
                         decode_steps=k).generate(prompts, params) for k in (1, 4)]
    assert_same(outs[1], outs[0])
    assert outs[1][0][0].finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_under_a_tight_cache(temperature):
    model = tiny_model("llama")
    prompts = random_prompts([6, 9, 3, 12])
    params = SamplingParams(n=2, temperature=temperature, max_tokens=24, seed=5, ignore_eos=True)
    roomy = make_engine(model, 1).generate(prompts, params)
    tight = make_engine(model, 4, num_kv_blocks=12)
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert_same(got, roomy)
    assert tight.blocks.num_used_blocks == 0


def test_lookahead_that_does_not_fit_decodes_one_step():
    """With too few free blocks for K tokens ahead, the scheduler gives a one-step decode (same tokens)."""
    model = tiny_model("llama")
    prompts = random_prompts([6, 9, 3, 12])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=5, ignore_eos=True)
    engine = make_engine(model, 8, num_kv_blocks=14)
    seen = []
    schedule = engine.scheduler.schedule

    def spy(lookahead=1):
        step = schedule(lookahead)
        if not step.is_prefill:
            seen.append(step.lookahead)
        return step

    engine.scheduler.schedule = spy
    got = engine.generate(prompts, params)
    assert 1 in seen and 8 in seen
    assert_same(got, make_engine(model, 1).generate(prompts, params))


def test_multi_turn_conversations_continue_on_their_blocks():
    model = tiny_model("qwen3")
    prompts = random_prompts([5, 9, 7])
    params = SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=3, stop_token_ids=STOPS)
    ref = make_engine(model, 1).generate_turns(prompts, params, scripted)
    engine = make_engine(model, 4)
    got = engine.generate_turns(prompts, params, scripted)
    assert_same(got, ref)
    assert any(c.turns == 3 for g in got for c in g)
    assert any(0 in c.mask for g in got for c in g)  # the scripted context went in
    assert set(CONTEXT) == {1, 2}
    assert engine.blocks.num_used_blocks == 0


def test_decode_steps_must_be_a_positive_integer():
    model = tiny_model("llama")
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="decode_steps"):
            make_engine(model, bad)
    assert make_engine(model, None).runner.decode_steps == 1  # default without CUDA graphs


def test_launch_copies_tokens_to_the_host_as_whole_contiguous_buffers(monkeypatch):
    # A copy into a column slice of a pinned buffer is not contiguous: torch stages it through pageable memory
    # and the host waits for the launch, so chained launches of fewer rows than max_num_seqs ran serially.
    import torch

    engine = make_engine(tiny_model("llama"), steps=4, max_num_seqs=16)
    outs = {t.data_ptr() for pair in engine.runner._multi_out for t in pair}
    seen: list[bool] = []
    copy = torch.Tensor.copy_

    def spy(self, src, non_blocking=False):
        if self.data_ptr() in outs:
            seen.append(self.is_contiguous() and self.numel() == src.numel())
        return copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    engine.generate(random_prompts([5, 7, 3]), SamplingParams(n=2, max_tokens=9, seed=1))  # 6 rows of 16
    assert seen and all(seen)

"""bench/long.py on the CPU: the long-tailed length draw is fixed by its seed and has the quantiles it is fitted
to, and each trainer stops every sequence at its drawn length (cohort through the engine's per-sample caps, TRL
by generating to the step's longest and cutting each completion), without a GPU or TRL."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.bench_modules import load_bench
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model

from cohort.engine import CohortEngine
from cohort.types import SamplingParams


@pytest.fixture(scope="module")
def long():
    return load_bench("long.py", "long_bench")


def test_the_draw_is_fixed_by_its_seed(long):
    kw = dict(median=1536, tail_frac=0.05, tail_at=8192, cap=16384)
    first, again = long.draw_lengths(500, seed=0, **kw), long.draw_lengths(500, seed=0, **kw)
    assert first == again
    assert long.draw_lengths(500, seed=1, **kw) != first
    assert long.describe([first], 8192)["sha256"] == long.describe([again], 8192)["sha256"]
    assert long.describe([first], 8192)["sha256"] != long.describe([long.draw_lengths(500, seed=1, **kw)], 8192)["sha256"]


def test_the_draw_has_the_median_and_the_tail_it_is_fitted_to(long):
    lengths = long.draw_lengths(40_000, median=1536, tail_frac=0.05, tail_at=8192, cap=16384, seed=0)
    stats = long.describe([lengths], 8192)
    assert abs(stats["p50"] - 1536) <= 0.03 * 1536, stats
    assert 0.045 <= stats["past_tail_at"] <= 0.055, stats  # 5% past 8,192 (the 95th percentile there)
    assert abs(stats["p95"] - 8192) <= 0.05 * 8192, stats
    assert min(lengths) >= 1 and max(lengths) == 16384  # ~1% would pass the cap: clipped to it
    assert abs(long.lognormal_sigma(1536, 0.05, 8192) - 1.0177) < 1e-3


def test_each_step_gets_its_own_list_and_the_measured_ones_match_whatever_the_warm_up(long):
    args = long.argparse.Namespace(prompts=3, generations=4, warmup=1, trl_warmup=0, steps=2, median=100,
                                   tail_frac=0.05, tail_at=400, cap=800, seed=7)
    measured = long.step_lengths(args, "lognormal")
    assert [len(s) for s in measured] == [12, 12]  # --steps lists of prompts x generations
    assert measured[0] != measured[1]
    warmed = long.step_lengths(args, "lognormal", warmup=2)  # a runner with two warm-up steps
    assert len(warmed) == 4 and warmed[2:] == measured  # its measured steps see the same lengths
    assert long.step_lengths(args, "4096") is None
    with pytest.raises(ValueError):
        long.lognormal_sigma(100, 0.05, 50)  # a tail below the median


def test_the_engine_stops_each_sample_at_its_drawn_length(long):
    tok = make_tiny_tokenizer()
    engine = CohortEngine(tiny_model(tok), tok, eos_token_ids=[tok.eos_token_id], decode_steps=4)
    params = SamplingParams(n=3, max_tokens=24, ignore_eos=True, seed=5)
    prompts = [[3, 4, 5], [6, 7]]
    lengths = [[9, 24, 1, 5, 5, 17]]  # one step: prompt-major, a group's samples side by side
    capped = long.stop_each(engine.generate, lengths)(prompts, params)
    assert [[len(c.token_ids) for c in group] for group in capped] == [[9, 24, 1], [5, 5, 17]]
    assert all(c.finish_reason == "length" for group in capped for c in group)
    whole = engine.generate(prompts, params)  # the same seeds: each capped sample is the start of the whole one
    for cut, full in zip([c for g in capped for c in g], [c for g in whole for c in g]):
        assert cut.token_ids == full.token_ids[:len(cut.token_ids)]
        assert cut.logprobs == pytest.approx(full.logprobs[:len(cut.token_ids)])
    with pytest.raises(RuntimeError, match="does not match the drawn lengths"):
        long.stop_each(engine.generate, lengths)([[3, 4, 5]], params)
    with pytest.raises(ValueError, match="max_tokens_each"):
        engine.generate(prompts, params, max_tokens_each=[[9, 30, 1], [5, 5, 17]])  # above max_tokens


def test_trl_generates_to_the_steps_longest_and_cuts_each_completion(long):
    """The TRL emulation: one generate call runs every row to the step's longest drawn length (as HF generate
    keeps a batch's rows until the longest ends), then each completion is cut to its own length."""
    trainer = long.SimpleNamespace(generation_config=long.SimpleNamespace(max_new_tokens=64, min_new_tokens=64),
                                   generation_kwargs={"max_new_tokens": 64, "min_new_tokens": 64})
    seen = []

    def generate(prompt_ids, images, fields, num_generations):
        steps = trainer.generation_config.max_new_tokens
        seen.append((steps, trainer.generation_config.min_new_tokens, trainer.generation_kwargs["min_new_tokens"]))
        return [[7] * steps for _ in prompt_ids], None

    wrapped = long.truncate_each(generate, trainer, [[3, 11, 6, 2], [5, 5, 5, 5]])
    ids, logprobs = wrapped([[1]] * 4, None, {}, 2)
    assert [len(c) for c in ids] == [3, 11, 6, 2] and logprobs is None
    assert wrapped([[1]] * 4, None, {}, 2)[0] == [[7] * 5] * 4
    assert seen == [(11, 11, 11), (5, 5, 5)]
    with pytest.raises(RuntimeError, match="does not match the drawn lengths"):
        wrapped([[1]] * 4, None, {}, 2)  # more calls than drawn steps


def test_trl_fit_prefers_no_checkpointing_then_the_largest_micro_batch(long):
    spec = {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
            "intermediate_size": 8960, "vocab_size": 151936}
    roomy = long.trl_fit(spec, 64, 256, 4096, 141e9)
    tight = long.trl_fit(spec, 64, 256, 4096, 80e9)
    assert roomy[1] is False and tight[1] is False and roomy[0] >= tight[0] >= 1 and 64 % tight[0] == 0
    assert long.trl_fit(spec, 64, 256, 32768, 80e9)[1] is True  # 32k tokens a row: only with checkpointing
    assert long.trl_fit(spec, 64, 256, 4096, 1e9) == (1, True)  # nothing fits: the smallest, checkpointed


def test_the_summary_counts_the_drawn_tokens(long, monkeypatch):
    args = long.argparse.Namespace(prompts=1, generations=2, warmup=1, trl_warmup=0, steps=2, median=10,
                                   tail_frac=0.05, tail_at=40, cap=64, seed=0, prompt_len=4)
    drawn = long.step_lengths(args, "lognormal")  # the measured steps
    res = {"num_params": 10_000, "share_prompts": True,
           "steps": [{"step": 2.0, "generate": 1.0, "update": 0.5, "other": 0.5}] * 3}  # one warm-up step first
    s = long.summarise(args, res, "tiny", "lognormal", 1)
    assert s["tokens_per_step"] == pytest.approx(sum(map(sum, drawn)) / 2) and s["measured_steps"] == 2
    assert s["gen_tok_s"] == pytest.approx(s["tokens_per_step"] / 1.0) and s["mfu"] > 0
    assert torch.isfinite(torch.tensor(s["mfu"]))


def test_release_kv_and_the_emulated_card_reach_the_child_and_the_config(long, monkeypatch):
    import grpo_step  # on sys.path once bench/long.py is loaded

    args = long.argparse.Namespace(device="cpu", warmup=1, trl_warmup=1, steps=1, prompts=1, generations=2,
                                   prompt_len=4, median=10, tail_frac=0.05, tail_at=40, cap=64, seed=0,
                                   token_budget=None, compile_layers=False, trl_micro=None, trl_gc=False,
                                   release_kv=True, emulate_total_mib=81559, log=None)
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        raise long.subprocess.TimeoutExpired(cmd, 1)
    monkeypatch.setattr(long.subprocess, "run", fake_run)
    long.run_child(args, "tiny", "32", "cohort", 1.0)
    cmd = seen["cmd"]
    assert "--release-kv" in cmd and cmd[cmd.index("--emulate-total-mib") + 1] == "81559"
    for release in (True, False):
        args.release_kv = release
        cfg = grpo_step._cohort_config(long.workload(args, "32", "tiny", 1), False, 0.3, 1024)
        assert cfg.generation.release_kv_during_update is release

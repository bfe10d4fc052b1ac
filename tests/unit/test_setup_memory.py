"""The engine's KV pool is sized after the trainer's needs: the memory check on a (simulated) GPU."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_models import tiny_llama

from cohort import setup
from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.setup import memory_plan

GIB = 2**30


def _run(monkeypatch, free_bytes: int) -> tuple[float, list[str]]:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    lines: list[str] = []
    cfg = CohortConfig()
    cfg.train.token_budget = 4096
    frac, est = memory_plan.plan_memory(cfg, tiny_llama(0), torch.device("cuda"), False, lines.append)
    assert est is not None and est.kv_cache == 0  # the engine's pool is added once the engine is built
    return frac, lines


def _need(estimate_memory) -> int:
    """What the update needs by the estimate, for the micro-batch the default config's step makes."""
    cfg = CohortConfig()
    cfg.train.token_budget = 4096
    tokens, completion = memory_plan.micro_batch_tokens(cfg)
    return estimate_memory(tiny_llama(0).config, dtype=torch.float32, token_budget=tokens, completion_tokens=completion,
                           chunk_tokens=cfg.train.logprob_chunk_tokens, fused_logprob_kernels=True).total


def test_plenty_of_memory_keeps_the_configured_fraction(monkeypatch):
    frac, lines = _run(monkeypatch, 40 * GIB)
    assert frac == CohortConfig().generation.kv_cache_fraction
    assert any(line.startswith("kv cache:") for line in lines)


def test_tight_memory_lowers_the_fraction(monkeypatch):
    from cohort.policy.memory import estimate_memory

    need = _need(estimate_memory)
    free = int(need / 0.8)  # the update leaves about a tenth of free memory, less than the 0.3 asked for
    frac, lines = _run(monkeypatch, free)
    assert 0.02 < frac < 0.3 and any("lowered" in line for line in lines)


def test_no_room_for_the_kv_cache_is_a_clear_error(monkeypatch):
    from cohort.policy.memory import estimate_memory

    need = _need(estimate_memory)
    with pytest.raises(ConfigError, match=r"token_budget"):
        _run(monkeypatch, int(need / 0.89))


def test_micro_batch_tokens_at_max_completion_length():
    cfg = CohortConfig()
    cfg.train.share_prompts = False  # every rollout a whole sequence (the shared layout: the next test)
    cfg.train.prompts_per_step, cfg.generation.num_generations, cfg.generation.max_completion_length = 4, 8, 64
    cfg.train.token_budget = 4096
    # 32 rollouts of 80 + 64 = 144 tokens: 28 fit in 4096, so two micro-batches of 16 (spread evenly)
    assert memory_plan.micro_batch_tokens(cfg, longest_prompt=80) == (16 * 144, 16 * 64)
    cfg.train.token_budget = 8192  # the whole step fits: one micro-batch of all 32
    assert memory_plan.micro_batch_tokens(cfg, longest_prompt=80) == (32 * 144, 32 * 64)
    cfg.train.token_budget = 100  # a sequence longer than the budget sits alone
    assert memory_plan.micro_batch_tokens(cfg, longest_prompt=80) == (144, 64)
    cfg.train.token_budget, cfg.train.mini_batches = 8192, 2  # each update sees half the step
    assert memory_plan.micro_batch_tokens(cfg, longest_prompt=80) == (16 * 144, 16 * 64)


def test_micro_batch_shape_with_shared_prompts():
    cfg = CohortConfig()
    assert cfg.train.share_prompts  # the default
    cfg.train.prompts_per_step, cfg.generation.num_generations, cfg.generation.max_completion_length = 4, 8, 64
    cfg.train.token_budget = 4096
    # a unit is a prompt and its 8 completions, 80 + 8 x 64 = 592 tokens: all 4 fit in one micro-batch, whose
    # completions gather the 80 prompt keys again each (32 x 80 key rows)
    assert memory_plan.micro_batch_shape(cfg, longest_prompt=80) == (4 * 592, 32 * 64, 32 * 80)
    cfg.train.token_budget = 1000  # one unit per micro-batch (two would be 1184)
    assert memory_plan.micro_batch_shape(cfg, longest_prompt=80) == (592, 8 * 64, 8 * 80)
    cfg.train.token_budget = 300  # 3 completions fit beside the prompt (80 + 3 x 64 = 272): units of 3
    assert memory_plan.micro_batch_shape(cfg, longest_prompt=80) == (272, 3 * 64, 3 * 80)
    cfg.train.token_budget = 100  # not even one completion fits beside the prompt: units of one, no gathering
    assert memory_plan.micro_batch_shape(cfg, longest_prompt=80) == (144, 64, 0)


def test_engine_memory_is_the_pool_as_allocated():
    from cohort.engine import CohortEngine

    engine = CohortEngine(tiny_llama(0), num_kv_blocks=7, max_model_len=64, fuse_projections=False)
    kv, copies = memory_plan.engine_memory(engine)
    pool = engine.runner.kv_cache
    assert kv == pool.numel() * pool.element_size() and copies == 0  # 7 blocks + the scratch block
    # 2 (K, V) x 1 layer x 8 blocks x 16 tokens (CPU block size) x 2 kv heads x 8 head dim x 4 bytes
    assert kv == 2 * 1 * 8 * 16 * 2 * 8 * 4
    assert memory_plan.engine_memory(object()) == (0, 0)  # Hugging Face generate: no pool


def test_build_components_prints_the_estimate_with_the_engines_pool():
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import tiny_model, toy_rows

    from cohort.data import load_prompt_dataset
    from cohort.rewards import RewardRunner

    cfg = CohortConfig()
    cfg.generation.num_generations, cfg.generation.max_completion_length, cfg.train.prompts_per_step = 4, 8, 2
    tok = make_tiny_tokenizer()
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    lines: list[str] = []
    comp = setup.build_components(cfg, policy=tiny_model(tok), tokenizer=tok, train_data=data, echo=lines.append,
                                  reward_runner=RewardRunner([lambda completions, **kw: [0.0] * len(completions)]))
    est = comp.memory_estimate
    assert est is not None and est.kv_cache == memory_plan.engine_memory(comp.engine)[0] > 0
    table = next(line for line in lines if line.startswith("memory estimate"))
    assert f"{'kv_cache':<15} {est.kv_cache / GIB:9.3f} GiB" in table
    assert f"{'total':<15} {est.total / GIB:9.3f} GiB" in table
    tokens, completion = memory_plan.micro_batch_tokens(cfg, max(len(ids) for ids in comp.train_data.prompt_ids))
    assert completion == 8 * 8 and tokens > completion  # 2 prompts x 4 completions of 8 tokens, prompts too

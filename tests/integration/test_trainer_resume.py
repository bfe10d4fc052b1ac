"""Resume is exact: N steps straight give the same metrics as k steps, stop, resume, N - k steps."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, tiny_model, toy_rows
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.config import apply_overrides
from cohort.data import load_prompt_dataset
from cohort.rewards import RewardRunner
from cohort.run.logging import read_jsonl
from cohort.setup import build_components
from cohort.trainer import train

VOLATILE = ("time", "step_time", "time/", "train_time")


def _rows(run_dir):
    return {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}


# the low-memory setting's optimiser (moments in host memory, bucketed) must resume exactly too
LOW_MEMORY = ["train.master_weights=false", "train.optimizer_offload=true", "generation.release_kv_during_update=true"]


# FSDP on one process (a world of one): the sharded DCP checkpoint must resume exactly as well
@pytest.mark.parametrize("overrides", [[], LOW_MEMORY, ["train.sharding=fsdp"]],
                         ids=["default", "low-memory", "fsdp-one-process"])
def test_resume_equals_uninterrupted(tmp_path, overrides):
    n, k = 5, 2
    straight = apply_overrides(toy_config(tmp_path / "a", steps=n), overrides)
    train(straight, toy_components(straight))

    first = apply_overrides(toy_config(tmp_path / "b", steps=k), overrides)
    train(first, toy_components(first))
    resumed = apply_overrides(toy_config(tmp_path / "b", steps=n), overrides)
    resumed.run.resume = True
    train(resumed, toy_components(resumed))  # a fresh process would rebuild everything, then load

    a, b = _rows(tmp_path / "a" / "run"), _rows(tmp_path / "b" / "run")
    assert sorted(a) == sorted(b) == list(range(1, n + 1))
    for step in range(1, n + 1):
        for key, value in a[step].items():
            if key.startswith(VOLATILE) or not isinstance(value, float):
                continue
            assert math.isclose(value, b[step][key], rel_tol=1e-5, abs_tol=1e-7), (step, key, value, b[step][key])


def noisy_digit_share(completions, digit, **kwargs):
    """A stochastic judge: digit_share plus noise from Python's, NumPy's and torch's global generators (the
    draws an LLM judge or a sampled verifier makes), so that a resumed run matches only if they are restored."""
    noise = [random.random() + float(np.random.rand()) + float(torch.rand(())) for _ in completions]
    return [r + 0.3 * (n - 1.5) for r, n in zip(digit_share(completions, digit), noise, strict=True)]


def _noisy_run(cfg):
    cfg.run.log_completions = True
    cfg.generation.num_generations, cfg.generation.max_completion_length, cfg.train.prompts_per_step = 4, 8, 2
    tok = make_tiny_tokenizer()
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    train(cfg, build_components(cfg, policy=tiny_model(tok), tokenizer=tok,
                                reward_runner=RewardRunner([noisy_digit_share]), train_data=data))


def _sampled(run_dir) -> dict[int, list]:
    """Each step's sampled completions (the tokens, as text) and their rewards, from samples.jsonl."""
    steps: dict[int, list] = {}
    for row in read_jsonl(run_dir / "samples.jsonl"):
        steps.setdefault(row["step"], []).append((row["completion"], row["reward"]))
    return steps


def test_resume_restores_the_random_generators(tmp_path):
    """Sampling is seeded per step, so only what else draws from the global generators (here a stochastic
    reward, through it the advantages, the update and the next step's sampled tokens) tells whether resume
    restored them: with rng.pt ignored, step 2 scores with step 1's noise and the runs part."""
    n, k = 3, 1
    _noisy_run(toy_config(tmp_path / "a", steps=n))
    _noisy_run(toy_config(tmp_path / "b", steps=k))
    resumed = toy_config(tmp_path / "b", steps=n)
    resumed.run.resume = True
    _noisy_run(resumed)

    a, b = _sampled(tmp_path / "a" / "run"), _sampled(tmp_path / "b" / "run")
    assert sorted(a) == sorted(b) == list(range(1, n + 1))
    for step in range(k + 1, n + 1):
        assert [c for c, _ in b[step]] == [c for c, _ in a[step]], f"step {step}: other tokens sampled after resume"
        assert [r for _, r in b[step]] == pytest.approx([r for _, r in a[step]], rel=1e-6), f"step {step}: rewards"
    assert len({c for c, _ in a[n]}) > 1  # (the tokens vary: their equality means something)

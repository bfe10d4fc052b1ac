"""Held-out evaluation: accuracy from the first reward, pass@k, greedy vs sampled, the eval completion cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cohort.config import CohortConfig, ConfigError
from cohort.data.dataset import PromptDataset
from cohort.evaluation import evaluate
from cohort.rewards import RewardRunner
from cohort.types import Completion, SamplingParams


class RecordingEngine:
    """Prompt p's sample j is the tokens [p, j]; remembers the sampling parameters of every call."""

    def __init__(self):
        self.calls: list[SamplingParams] = []

    def generate(self, prompts, params):
        self.calls.append(params)
        return [[Completion([p[0], j], [0.0, 0.0], "stop") for j in range(params.n)] for p in prompts]


class Tok:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


class Policy:
    training = True

    def eval(self):
        self.training = False

    def train(self):
        self.training = True


def correct_when(prompts, completion_ids, target, **kwargs):
    # prompt p is answered correctly by sample j when j == target (targets >= n: never)
    return [1.0 if ids[1] == t else 0.0 for ids, t in zip(completion_ids, target)]


def half_credit(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def _components(targets):
    rows = [{"prompt": f"q{i}", "target": t} for i, t in enumerate(targets)]
    data = PromptDataset(rows, "toy")
    data.prompt_ids = [[i] for i in range(len(rows))]
    return SimpleNamespace(
        engine=RecordingEngine(), tokenizer=Tok(), policy=Policy(), eval_data=data,
        sampling_params=SamplingParams(n=8, max_tokens=64, temperature=0.9),
        reward_runner=RewardRunner([correct_when, half_credit]))


def test_greedy_accuracy_reads_the_first_reward_and_restores_training_mode():
    comp = _components([0, 0, 1, 5])  # greedy: one sample, index 0, so prompts 0 and 1 are right
    cfg = CohortConfig()
    out = evaluate(comp, cfg, batch_prompts=3)  # two engine calls: 3 + 1 prompts
    # 2 of 4 right: the Wilson interval 0.5 -+ 1.96 sqrt(1/16 + 1.96^2/64) / (1 + 1.96^2/4)
    assert out == {"accuracy": 0.5, "reward": pytest.approx((2 * 1.5 + 2 * 0.5) / 4),
                   "accuracy_ci_low": pytest.approx(0.1500389892), "accuracy_ci_high": pytest.approx(0.8499610108)}
    assert [p.n for p in comp.engine.calls] == [1, 1]
    assert all(p.temperature == 0.0 and p.max_tokens == 64 for p in comp.engine.calls)
    assert comp.policy.training


def test_pass_at_k_samples_at_the_training_temperature():
    comp = _components([0, 2, 3, 9])  # k=4 samples j=0..3: prompts 0, 1, 2 have one correct sample each
    cfg = CohortConfig()
    cfg.run.eval_num_samples = 4
    out = evaluate(comp, cfg)
    assert out["pass@4"] == 0.75
    assert out["accuracy"] == 3 / 16
    assert comp.engine.calls[0].n == 4 and comp.engine.calls[0].temperature == 0.9


def test_eval_completion_cap_overrides_the_training_cap():
    comp = _components([0])
    cfg = CohortConfig()
    cfg.run.eval_max_completion_length = 320
    evaluate(comp, cfg)
    assert comp.engine.calls[0].max_tokens == 320
    assert comp.sampling_params.max_tokens == 64  # training's parameters untouched


def test_eval_completion_cap_must_be_positive():
    cfg = CohortConfig()
    cfg.run.eval_max_completion_length = 0
    with pytest.raises(ConfigError, match=r"run\.eval_max_completion_length"):
        cfg.validate()


def test_samples_lists_every_completion_with_its_reward():
    comp = _components([0, 1])
    rows: list[dict] = []
    evaluate(comp, CohortConfig(), samples=rows)
    assert rows == [{"prompt": "q0", "completion": "0 0", "reward": 1.5, "correct": True},
                    {"prompt": "q1", "completion": "1 0", "reward": 0.5, "correct": False}]

"""Sampled-evaluation statistics against hand numbers (arithmetic in the comments): unbiased pass@k, maj@n,
mean@n, the Wilson interval; the answers each reward function votes with; evaluate's new keys and its seeds."""

from __future__ import annotations

import functools
import math
import random
from types import SimpleNamespace

import pytest
from tests.unit.test_evaluation import Tok  # the decoding stub those tests share

from cohort.algorithms import majority_correct, pass_at_k, pass_at_k_ks, sampled_eval_metrics, wilson_interval
from cohort.config import CohortConfig
from cohort.data.dataset import PromptDataset
from cohort.evaluation import evaluate
from cohort.rewards import RewardRunner, accuracy, answer_number, reasoning_gym_score
from cohort.rewards.registry import answer_extractor
from cohort.types import Completion, SamplingParams


# -- pass@k --------------------------------------------------------------------------------------------
def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3, 2) / C(5, 2) = 1 - 3 / 10
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # 1 - C(3, 1) / C(5, 1) = 1 - 3 / 5 = c / n
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3, 2) / C(4, 2) = 1 - 3 / 6
    assert pass_at_k(5, 2, 4) == 1.0  # n - c = 3 < k = 4: every 4 of the 5 include a correct one
    assert pass_at_k(8, 0, 4) == 0.0  # 1 - C(8, 4) / C(8, 4)
    assert pass_at_k(8, 3, 8) == 1.0  # k = n: any correct sample


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_the_reported_ks_are_one_and_powers_of_two_below_n():
    assert pass_at_k_ks(8) == [1, 2, 4]  # pass@8 is the evaluation's existing pass@n
    assert pass_at_k_ks(5) == [1, 2, 4]
    assert pass_at_k_ks(2) == [1]
    assert pass_at_k_ks(1) == []


# -- maj@n ---------------------------------------------------------------------------------------------
def test_majority_vote_by_hand():
    # "4" and "5" both have 2 votes: the first seen ("4") wins; its 2 samples are correct -> 1.0
    assert majority_correct(["4", "5", "4", "5", "6"], [True, False, True, False, False]) == 1.0
    # "7" has 3 votes, all wrong -> 0.0
    assert majority_correct(["7", "7", "3", "7"], [False, False, True, False]) == 0.0
    # the winner's samples disagree (lossy extraction): the share that is correct, 1 of 2
    assert majority_correct(["a", "a", "b"], [True, False, True]) == 0.5
    with pytest.raises(ValueError, match="one outcome per answer"):
        majority_correct(["a"], [True, False])


# -- Wilson --------------------------------------------------------------------------------------------
def test_wilson_interval_by_hand():
    # 8 of 10, z = 1.9599640, z^2 = 3.8414588: denom = 1 + 0.38414588 = 1.38414588
    # centre = (0.8 + 3.8414588 / 20) / denom = 0.99207294 / 1.38414588 = 0.71674016
    # half = z * sqrt(0.8 * 0.2 / 10 + 3.8414588 / 400) / denom = 1.9599640 * sqrt(0.02560365) / 1.38414588
    #      = 1.9599640 * 0.16001140 / 1.38414588 = 0.22657769
    low, high = wilson_interval(8, 10)
    assert (low, high) == (pytest.approx(0.71674016 - 0.22657769, abs=1e-7),
                           pytest.approx(0.71674016 + 0.22657769, abs=1e-7))  # [0.4901625, 0.9433178]
    # 0 of 10: centre = half = (3.8414588 / 20) / 1.38414588 = 0.13876640 -> [0, 0.27753280]
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.27753280, abs=1e-7))
    assert wilson_interval(10, 10) == (pytest.approx(1 - 0.27753280, abs=1e-7), pytest.approx(1.0))
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_sampled_metrics_of_three_prompts_of_five_samples():
    correct = [[1, 0, 1, 0, 1], [0, 1, 0, 1, 0], [0, 0, 0, 0, 0]]  # c = 3, 2, 0
    answers = [["e", "o", "e", "o", "e"]] * 3  # "e" wins everywhere (3 votes)
    out = sampled_eval_metrics(correct, answers)
    assert set(out) == {"pass@1", "pass@2", "pass@4", "maj@5", "mean@5", "accuracy_ci_low", "accuracy_ci_high"}
    assert out["pass@1"] == pytest.approx((3 / 5 + 2 / 5 + 0) / 3)  # = 1/3
    # p0: 1 - C(2, 2) / C(5, 2) = 0.9; p1: 1 - C(3, 2) / 10 = 0.7; p2: 0 -> 1.6 / 3
    assert out["pass@2"] == pytest.approx(1.6 / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)  # p0, p1: n - c < 4 -> 1; p2: 0
    assert out["maj@5"] == pytest.approx(1 / 3)  # "e" is right for p0 only
    assert out["mean@5"] == pytest.approx(5 / 15)
    assert (out["accuracy_ci_low"], out["accuracy_ci_high"]) == wilson_interval(5, 15)
    assert sampled_eval_metrics([], []) == {}


# -- the answers that vote -----------------------------------------------------------------------------
def test_answer_extractors_of_the_builtins():
    assert answer_extractor(accuracy)("so <answer> x  + 1 </answer>", {}) == "x + 1"
    assert answer_extractor(accuracy)(r"it is \boxed{42}", {}) == "42"
    assert answer_extractor(accuracy)("no answer here", {}) is None
    assert answer_extractor(answer_number)("3 + 4 = 7.0", {}) == "7"
    assert answer_extractor(answer_number)("half: 0.5", {}) == "0.5"
    rg = answer_extractor(reasoning_gym_score)
    assert rg("4 - 1 = 3\nSo 3.", {"answer": "3"}) == "3"  # numeric gold: the last number
    bound = answer_extractor(functools.partial(reasoning_gym_score, extract="last_line"))
    assert bound("4 - 1 = 3\nthree", {"answer": "3"}) == "three"


def test_a_user_function_brings_its_own_extractor_or_none():
    def graded(completions, **kwargs):
        return [1.0] * len(completions)

    assert answer_extractor(graded) is None
    graded.extract_answer = lambda text: text.split()[-1]  # type: ignore[attr-defined]
    assert answer_extractor(graded)("the answer is blue", {}) == "blue"


# -- evaluate --------------------------------------------------------------------------------------------
class SeededEngine:
    """Completion j of prompt i is [p, x], x drawn from random.Random(seed + i * n + j) (the engine contract):
    it depends on the seed only, never on the batching."""

    def __init__(self):
        self.calls: list[SamplingParams] = []

    def generate(self, prompts, params):
        self.calls.append(params)
        return [[Completion([p[0], random.Random(params.seed + i * params.n + j).randrange(10)], [0.0, 0.0], "stop")
                 for j in range(params.n)] for i, p in enumerate(prompts)]


class IndexEngine(SeededEngine):
    """Completion j of prompt p is [p, j]."""

    def generate(self, prompts, params):
        self.calls.append(params)
        return [[Completion([p[0], j], [0.0, 0.0], "stop") for j in range(params.n)] for p in prompts]


class Policy:
    training = False

    def eval(self):
        pass

    def train(self):
        pass


def parity_right(completion_ids, target, **kwargs):
    # correct when the sample's second token has the target parity (target 5: never)
    return [1.0 if ids[1] % 2 == t else 0.0 for ids, t in zip(completion_ids, target)]


def parity(text: str) -> str:
    return "even" if int(text.split()[1]) % 2 == 0 else "odd"


parity_right.extract_answer = parity  # type: ignore[attr-defined]


def components(engine, targets, reward=parity_right):
    rows = [{"prompt": f"q{i}", "target": t} for i, t in enumerate(targets)]
    data = PromptDataset(rows, "toy")
    data.prompt_ids = [[i] for i in range(len(rows))]
    return SimpleNamespace(engine=engine, tokenizer=Tok(), policy=Policy(), eval_data=data,
                           sampling_params=SamplingParams(n=8, max_tokens=16, temperature=1.0),
                           reward_runner=RewardRunner([reward]))


def sampled_config(n: int) -> CohortConfig:
    cfg = CohortConfig()
    cfg.run.eval_num_samples = n
    return cfg


def test_evaluate_reports_the_new_keys_beside_the_old_ones():
    # n = 5, samples j = 0..4: even j (0, 2, 4) are 3 votes, odd (1, 3) 2, so "even" wins every majority vote
    # prompt 0 (target 0): correct [1, 0, 1, 0, 1], c = 3, maj right; prompt 1 (target 1): c = 2, maj wrong;
    # prompt 2 (target 5): c = 0
    out = evaluate(components(IndexEngine(), [0, 1, 5]), sampled_config(5))
    assert out["accuracy"] == pytest.approx(5 / 15) and out["pass@5"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx(1 / 3)
    assert out["pass@2"] == pytest.approx((0.9 + 0.7 + 0.0) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["maj@5"] == pytest.approx(1 / 3)
    assert out["mean@5"] == pytest.approx(1 / 3)
    # Wilson for 5 of 15: p = 1/3, z^2 / n = 3.8414588 / 15 = 0.25609725, denom 1.25609725;
    # centre = (0.33333333 + 0.12804863) / 1.25609725 = 0.36731388
    # half = 1.9599640 * sqrt(0.22222222 / 15 + 3.8414588 / 900) / 1.25609725 = 1.9599640 * sqrt(0.01908310)
    #      / 1.25609725 = 1.9599640 * 0.13814160 / 1.25609725 = 0.21555064
    assert out["accuracy_ci_low"] == pytest.approx(0.36731388 - 0.21555064, abs=1e-7)
    assert out["accuracy_ci_high"] == pytest.approx(0.36731388 + 0.21555064, abs=1e-7)


def test_majority_vote_falls_back_to_the_stripped_text():
    def by_target(completion_ids, target, **kwargs):
        return [1.0 if ids[1] == t else 0.0 for ids, t in zip(completion_ids, target)]

    # no extractor: the texts "0 0", "0 1", "0 2", "0 3" are all different, the first wins the tie
    out = evaluate(components(IndexEngine(), [0], reward=by_target), sampled_config(4))
    assert out["maj@4"] == 1.0
    out = evaluate(components(IndexEngine(), [1], reward=by_target), sampled_config(4))
    assert out["maj@4"] == 0.0 and out["pass@4"] == 1.0


def test_two_evaluations_agree_and_do_not_depend_on_the_batching():
    comp, rows_a, rows_b, rows_c = components(SeededEngine(), [0, 1, 0, 1, 0]), [], [], []
    first = evaluate(comp, sampled_config(4), batch_prompts=2, samples=rows_a)
    again = evaluate(comp, sampled_config(4), batch_prompts=2, samples=rows_b)
    whole = evaluate(comp, sampled_config(4), batch_prompts=5, samples=rows_c)
    assert first == again == whole and rows_a == rows_b == rows_c
    # batches of 2 prompts of 4 samples: seeds 42, 42 + 2 * 4, 42 + 4 * 4 (then the three calls of `again`)
    assert [c.seed for c in comp.engine.calls[:3]] == [42, 50, 58]
    assert comp.engine.calls[-1].seed == 42


def test_greedy_evaluation_adds_only_the_interval():
    out = evaluate(components(IndexEngine(), [0, 1]), CohortConfig())
    assert set(out) == {"accuracy", "reward", "accuracy_ci_low", "accuracy_ci_high"}
    assert math.isclose(out["accuracy"], 0.5)
    # Wilson, 1 of 2 greedy answers right: centre 0.5, half-width 1.96 sqrt(1/8 + 1.96^2/16) / (1 + 1.96^2/2)
    assert math.isclose(out["accuracy_ci_low"], 0.0945312057, rel_tol=1e-8)
    assert math.isclose(out["accuracy_ci_high"], 0.9054687943, rel_tol=1e-8)

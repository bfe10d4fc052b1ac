"""RewardRunner: TRL's reward contract, concurrency, None handling, weights, and every error kind."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch

from cohort.errors import CohortError, ConfigError
from cohort.rewards import RewardError, RewardRunner

PROMPTS = ["What is 2 + 2?", "What is 3 + 3?", "Name a colour."]
COMPLETIONS = ["It is 4.", "It is 7.", "Blue."]
IDS = [[1, 2, 3], [4, 5], [6]]
COLUMNS = {"answer": ["4", "6", None], "task": ["math", "math", "words"]}


def length(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def math_only(completions, answer, task, **kwargs):
    return [float(a in c) if t == "math" else None for c, a, t in zip(completions, answer, task)]


def test_contract_passes_every_argument_by_keyword():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, answer, task, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, answer=answer)
        seen["extra"] = sorted(kwargs)
        return [0.0] * len(prompts)

    RewardRunner([spy])(PROMPTS, COMPLETIONS, IDS, COLUMNS, trainer_state={"step": 3})
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS and seen["ids"] == IDS
    assert seen["state"] == {"step": 3} and seen["answer"] == ["4", "6", None]
    assert seen["extra"] == ["log_extra", "log_metric"]  # TRL 1.16's logging hooks


def test_log_metric_and_log_extra_as_trl():
    def logs(completions, log_metric, log_extra, **kwargs):
        log_metric("my/length", sum(len(c) for c in completions) / len(completions))
        log_extra("note", [f"n{i}" for i in range(len(completions))])
        return [0.0] * len(completions)

    result = RewardRunner([logs])(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert result.metrics()["my/length"] == sum(len(c) for c in COMPLETIONS) / len(COMPLETIONS)
    assert result.extra == {"note": ["n0", "n1", "n2"]} and result.select([2]).extra == {"note": ["n2"]}
    both = type(result).concat([result, result])
    assert both.metrics()["my/length"] == result.metrics()["my/length"] and len(both.extra["note"]) == 6


def test_function_without_kwargs_gets_only_what_it_names():
    def only_completions(completions):
        return [float(len(c)) for c in completions]

    result = RewardRunner([only_completions])(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert result.rewards[:, 0].tolist() == [8.0, 8.0, 5.0]


def test_missing_column_names_function_and_columns():
    def needs_solution(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as e:
        RewardRunner([needs_solution])(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    msg = str(e.value)
    assert "'needs_solution'" in msg and "['solution']" in msg and "['answer', 'task']" in msg


def test_none_becomes_nan_and_is_ignored_by_stats_and_total():
    result = RewardRunner([math_only, length], weights=[2.0, 0.5])(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert result.names == ["math_only", "length"]
    pf = result.rewards
    assert pf.shape == (3, 2) and pf.dtype == torch.float32
    assert pf[:2, 0].tolist() == [1.0, 0.0] and math.isnan(pf[2, 0])
    # total = 2 * math_only + 0.5 * length, NaN counted as 0: [2 + 1.5, 0 + 1, 0 + 0.5]
    assert result.total.tolist() == [3.5, 1.0, 0.5]
    assert result.mean == {"math_only": 0.5, "length": 2.0}
    assert result.std["math_only"] == pytest.approx(math.sqrt(0.5))  # Bessel-corrected, as TRL's nanstd
    assert result.std["length"] == pytest.approx(1.0)
    m = result.metrics()
    assert m["rewards/math_only/mean"] == 0.5 and m["rewards/length/std"] == pytest.approx(1.0)
    assert result.all_none_rows == []


def test_default_weights_and_duplicate_names():
    result = RewardRunner([length, length])(PROMPTS, COMPLETIONS, IDS)
    assert result.names == ["length", "length_2"]
    assert result.weights.tolist() == [1.0, 1.0]
    assert result.total.tolist() == [6.0, 4.0, 2.0]


def test_weights_length_mismatch_is_config_error():
    with pytest.raises(ConfigError, match=r"reward_weights has 1 values for 2 reward functions \['length', 'math_only'\]"):
        RewardRunner([length, math_only], weights=[1.0])


def test_builtin_name_and_import_path():
    runner = RewardRunner(["answer_number", "tests.unit.test_rewards_runner:length"])
    assert runner.names == ["answer_number", "length"]
    result = runner(PROMPTS, COMPLETIONS, IDS, {"answer": ["4", "6", "x"]})
    assert result.rewards[:2].tolist() == [[1.0, 3.0], [0.0, 2.0]]
    assert math.isnan(result.rewards[2, 0])


def test_async_functions_run_concurrently():
    # Each waits for an event only the other one sets: run one after the other, the first would time out.
    a_started, b_started = asyncio.Event(), asyncio.Event()

    async def first(completions, **kwargs):
        a_started.set()
        await asyncio.wait_for(b_started.wait(), 10)
        return [1.0] * len(completions)

    async def second(completions, **kwargs):
        b_started.set()
        await asyncio.wait_for(a_started.wait(), 10)
        return [2.0] * len(completions)

    result = RewardRunner([first, second])(PROMPTS, COMPLETIONS, IDS)
    assert result.rewards[:, 0].tolist() == [1.0] * 3 and result.rewards[:, 1].tolist() == [2.0] * 3


def test_async_functions_overlap_with_sync_ones():
    # The async function is started before the sync one runs, and waits for an event the sync one sets.
    sync_ran = threading.Event()

    async def waits_for_sync(completions, **kwargs):
        ok = await asyncio.to_thread(sync_ran.wait, 10)
        return [1.0 if ok else 0.0] * len(completions)

    def sets_event(completions, **kwargs):
        sync_ran.set()
        return [0.5] * len(completions)

    result = RewardRunner([waits_for_sync, sets_event])(PROMPTS, COMPLETIONS, IDS)
    assert result.rewards.tolist() == [[1.0, 0.5]] * 3


def raises_on_blue(completions, **kwargs):
    if any("Blue" in c for c in completions):
        raise KeyError("colour table")
    return [1.0] * len(completions)


def test_raising_function_error_names_function_sample_and_fix():
    with pytest.raises(RewardError) as e:
        RewardRunner([raises_on_blue])(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    msg = str(e.value)
    assert isinstance(e.value, CohortError)
    assert "'raises_on_blue'" in msg and "KeyError" in msg and "colour table" in msg
    assert "sample 2 of 3" in msg and "'Name a colour.'" in msg and "'Blue.'" in msg
    assert "on_error='skip'" in msg


def test_skip_gives_nan_only_to_the_failing_sample_and_counts_it():
    runner = RewardRunner([raises_on_blue, length], on_error="skip")
    result = runner(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert result.rewards[:2, 0].tolist() == [1.0, 1.0] and math.isnan(result.rewards[2, 0])
    assert result.num_errors == {"raises_on_blue": 1, "length": 0}
    assert result.metrics()["rewards/raises_on_blue/num_errors"] == 1.0
    runner(PROMPTS, COMPLETIONS, IDS, COLUMNS)
    assert runner.total_errors["raises_on_blue"] == 2


def test_wrong_number_of_values_always_raises():
    def too_few(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    for policy in ("raise", "skip"):
        with pytest.raises(RewardError, match=r"'too_few' returned 2 values for 3 completions.*exactly one float"):
            RewardRunner([too_few], on_error=policy)(PROMPTS, COMPLETIONS, IDS)


def test_not_a_list_raises():
    def scalar(completions):
        return 1.0

    with pytest.raises(RewardError, match=r"'scalar' returned a float, not a list"):
        RewardRunner([scalar])(PROMPTS, COMPLETIONS, IDS)


@pytest.mark.parametrize(("bad", "text"), [(float("nan"), "nan is not finite"), (float("inf"), "inf is not finite"), ("1.0", "str '1.0' is not a number")])
def test_non_finite_or_non_number_value(bad, text):
    def odd(completions, **kwargs):
        return [1.0, bad, 0.0]

    with pytest.raises(RewardError) as e:
        RewardRunner([odd])(PROMPTS, COMPLETIONS, IDS)
    msg = str(e.value)
    assert "'odd'" in msg and text in msg and "sample 1 of 3" in msg and "'What is 3 + 3?'" in msg
    assert "return a finite float, or None" in msg
    result = RewardRunner([odd], on_error="skip")(PROMPTS, COMPLETIONS, IDS)
    assert result.rewards[[0, 2], 0].tolist() == [1.0, 0.0] and math.isnan(result.rewards[1, 0])
    assert result.num_errors == {"odd": 1}


def test_numpy_and_tensor_values_are_accepted():
    np = pytest.importorskip("numpy", reason="needs numpy: pip install numpy")

    def mixed(completions, **kwargs):
        return [np.float32(0.5), torch.tensor(2.0), True]

    assert RewardRunner([mixed])(PROMPTS, COMPLETIONS, IDS).rewards[:, 0].tolist() == [0.5, 2.0, 1.0]


def test_sync_timeout_raises_and_skip_counts_whole_batch():
    release = threading.Event()

    def slow(completions, **kwargs):
        release.wait(30)
        return [1.0] * len(completions)

    try:
        with pytest.raises(RewardError, match=r"'slow' timed out after 0.2 s on a batch of 3 completions"):
            RewardRunner([slow], timeout_s=0.2)(PROMPTS, COMPLETIONS, IDS)
        result = RewardRunner([slow, length], timeout_s=0.2, on_error="skip")(PROMPTS, COMPLETIONS, IDS)
        assert torch.isnan(result.rewards[:, 0]).all() and result.rewards[:, 1].tolist() == [3.0, 2.0, 1.0]
        assert result.num_errors["slow"] == 3
    finally:
        release.set()


def test_async_timeout():
    async def hangs(completions, **kwargs):
        await asyncio.sleep(30)
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'hangs' timed out after 0.2 s"):
        RewardRunner([hangs], timeout_s=0.2)(PROMPTS, COMPLETIONS, IDS)


def test_async_error_names_sample():
    async def bad_async(completions, **kwargs):
        if "Blue." in completions:
            raise RuntimeError("judge unavailable")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'bad_async' raised RuntimeError: judge unavailable on sample 2 of 3"):
        RewardRunner([bad_async])(PROMPTS, COMPLETIONS, IDS)


def test_conversational_completions_are_passed_through():
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    result = RewardRunner(["answer_number"])(prompts, completions, IDS, {"answer": ["4", "6", "x"]})
    assert result.rewards[:2, 0].tolist() == [1.0, 0.0]


def test_column_length_mismatch():
    with pytest.raises(ValueError, match=r"3 prompts but \{\"column 'answer'\": 2\}"):
        RewardRunner([length])(PROMPTS, COMPLETIONS, IDS, {"answer": ["1", "2"]})


def test_bad_policy_and_timeout_values():
    with pytest.raises(ConfigError, match="on_error='ignore'"):
        RewardRunner([length], on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="timeout_s=0"):
        RewardRunner([length], timeout_s=0)


def test_partial_bound_settings_are_not_overridden_by_columns():
    import functools

    def scaled(completion_ids, scale, **kwargs):
        return [scale * len(ids) for ids in completion_ids]

    runner = RewardRunner([functools.partial(scaled, scale=2.0)])
    assert runner.names == ["scaled"]
    result = runner(PROMPTS, COMPLETIONS, IDS, {"scale": [100.0, 100.0, 100.0]})
    assert result.rewards[:, 0].tolist() == [6.0, 4.0, 2.0]


def test_callable_instance_with_async_call():
    class Judge:
        async def __call__(self, completions, **kwargs):
            await asyncio.sleep(0)
            return [float(len(c)) for c in completions]

    result = RewardRunner([Judge()])(PROMPTS, COMPLETIONS, IDS)
    assert result.names == ["Judge"] and result.rewards[:, 0].tolist() == [8.0, 8.0, 5.0]

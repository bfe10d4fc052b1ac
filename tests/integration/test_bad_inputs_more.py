"""Bad inputs that are not one `cohort` command line (issue 35): reward time limits and all-None rewards through
the Python API, the TRL facade's checks before any model loads, the recipe reader's limits, lone surrogates from
any source, an unwritable run directory and the length of an error line. The command-line cases are rows of
CASES in test_bad_inputs.py; `none_for_all` and `sleeps_a_minute` below are reward functions two of them name.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch

from cohort.errors import CohortError, ConfigError

PROMPTS = ["What is 2 + 2?", "Name a colour.", "Say hi."]
COMPLETIONS = ["4", "Blue.", "hi"]
IDS = [[1], [2, 3], [4]]


# ------------------------------------------------------------------ reward functions CASES names by import path
def none_for_all(completions, **kwargs):
    return [None] * len(completions)


def sleeps_a_minute(completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)


# ------------------------------------------------------------------------------------------ reward time limits
def test_reward_calls_have_a_finite_default_limit_and_null_means_none():
    from cohort.config import CohortConfig, load_config
    from cohort.rewards import RewardRunner
    from cohort.setup.rewards import build_reward_runner

    assert CohortConfig().reward.timeout_s == 300.0
    assert build_reward_runner(CohortConfig()).timeout_s == 300.0
    assert RewardRunner([none_for_all]).timeout_s == 300.0
    assert load_config(None, ["reward.timeout_s=null"]).reward.timeout_s is None
    assert load_config(None, ["reward.timeout_s=null"]).reward.on_error == "raise"


def test_an_overrunning_sync_function_is_stopped_and_named():
    """Under the default limit a sync function runs in the calling (main) thread, as without a limit (math-verify's
    signal.alarm timeouts keep working); one that overruns is interrupted there, not left spinning beside training."""
    from cohort.rewards import RewardError, RewardRunner

    where: list[bool] = []

    def spy(completions, **kwargs):
        where.append(threading.current_thread() is threading.main_thread())
        return [1.0] * len(completions)

    assert RewardRunner([spy])(PROMPTS, COMPLETIONS, IDS).rewards[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert where == [True]
    spins = [0]

    def spinning(completions, **kwargs):
        while True:
            spins[0] += 1

    with pytest.raises(RewardError, match=r"'spinning' timed out after 0.3 s .*reward.timeout_s"):
        RewardRunner([spinning], timeout_s=0.3)(PROMPTS, COMPLETIONS, IDS)
    count = spins[0]
    time.sleep(0.2)
    assert spins[0] == count, "the timed-out function is still running"
    # the runner's signal handler is gone again
    import signal

    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_an_async_function_that_blocks_the_event_loop_times_out():
    from cohort.rewards import RewardError, RewardRunner

    release, finished, released = threading.Event(), threading.Event(), []

    async def blocking(completions, **kwargs):
        released.append(release.wait(60))  # never awaits: asyncio.wait_for alone cannot stop it
        finished.set()
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'blocking' timed out after 0.3 s"):
        RewardRunner([blocking], timeout_s=0.3)(PROMPTS, COMPLETIONS, IDS)
    release.set()  # only now: a runner that had waited for the blocked call would have let its wait run out
    assert finished.wait(90), "the blocked call never ended"  # before another test uses the shared event loop
    assert released == [True], "the runner returned only once the blocked call had ended"


# ------------------------------------------------------------------------------------------ all-None rewards
def test_all_none_batch_is_an_error_naming_each_function():
    from cohort.rewards import AllNoneRewardsError, RewardRunner

    def math_only(completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    with pytest.raises(AllNoneRewardsError) as info:
        RewardRunner([none_for_all, math_only])(PROMPTS, COMPLETIONS, IDS, {"task": ["code"] * 3})
    message = str(info.value)
    assert isinstance(info.value, CohortError) and "\n" not in message
    assert "'none_for_all', 'math_only' returned None for all 3 completions" in message
    assert "return a float for every completion (0.0 when the function does not apply" in message
    # one scored sample is enough: multi-task None stays as it was
    result = RewardRunner([none_for_all, math_only])(PROMPTS, COMPLETIONS, IDS, {"task": ["code", "math", "code"]})
    assert torch.isnan(result.rewards[:, 0]).all() and result.rewards[1, 1] == 1.0


def test_all_none_keeps_on_error_skip_semantics():
    """A batch that is all NaN because a function raised and on_error=skip is a skipped batch (counted), as before."""
    from cohort.rewards import AllNoneRewardsError, RewardRunner

    def down(completions, **kwargs):
        raise ConnectionError("judge unavailable")

    result = RewardRunner([down, none_for_all], on_error="skip")(PROMPTS, COMPLETIONS, IDS)
    assert torch.isnan(result.rewards).all() and result.num_errors["down"] == 3
    with pytest.raises(AllNoneRewardsError):
        RewardRunner([none_for_all], on_error="skip")(PROMPTS, COMPLETIONS, IDS)


def test_all_none_in_evaluation_warns_and_reports():
    from cohort.rewards import RewardRunner
    from cohort.types import TrainerState

    state = TrainerState(global_step=-1, max_steps=2, is_eval=True)
    with pytest.warns(UserWarning, match=r"'none_for_all' returned None for all 3 completions.*reward 0"):
        result = RewardRunner([none_for_all])(PROMPTS, COMPLETIONS, IDS, trainer_state=state)
    assert result.total.tolist() == [0.0, 0.0, 0.0]


def test_all_none_under_dynamic_sampling_stops_the_run(tmp_path):
    """Dynamic sampling scores each try as a batch: an all-None try is the same error, not an endless resample."""
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import tiny_model, toy_rows

    from cohort.config import load_config
    from cohort.data import load_prompt_dataset
    from cohort.rewards import AllNoneRewardsError, RewardRunner
    from cohort.setup import build_components
    from cohort.trainer import train

    tok = make_tiny_tokenizer()
    cfg = load_config(None, ["train.max_steps=1", "train.prompts_per_step=2", "generation.num_generations=2",
                             "generation.max_completion_length=4", f"run.output_dir={tmp_path / 'run'}",
                             "run.report_to=[jsonl]", "reward.dynamic_sampling=true", "train.device=cpu"])
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    comp = build_components(cfg, policy=tiny_model(tok), tokenizer=tok, reward_runner=RewardRunner([none_for_all]),
                            train_data=data, echo=lambda *a: None)
    with pytest.raises(AllNoneRewardsError, match="'none_for_all' returned None for all 4 completions"):
        train(cfg, comp, echo=lambda *a, **k: None)


# ------------------------------------------------------------------------- the TRL facade, before any model loads
@pytest.mark.parametrize(("field", "value", "cohort_key"), [
    ("learning_rate", float("inf"), "train.learning_rate=inf"),
    ("learning_rate", -1e-6, "train.learning_rate=-1e-06"),
    ("max_grad_norm", float("nan"), "train.max_grad_norm=nan"),
    ("temperature", -0.5, "generation.temperature=-0.5"),
    ("adam_beta2", 1.5, "train.adam_beta2=1.5"),
])
def test_facade_rejects_bad_numbers_before_loading_the_model(field, value, cohort_key, tmp_path, monkeypatch):
    from tests.helpers.toy_task import write_toy_workspace

    from cohort.trl_compat import GRPOConfig, GRPOTrainer

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    for name, module in list(sys.modules.items()):  # wherever the facade reaches a loader from
        for attr in ("load_policy", "load_vision_policy"):
            if name.startswith("cohort.") and callable(getattr(module, attr, None)):
                monkeypatch.setattr(module, attr, no_loading)
    model_dir, _ = write_toy_workspace(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_steps=1, report_to="none", use_cpu=True, **{field: value})
    rows = [{"prompt": f"Say {d}", "digit": str(d)} for d in range(4)]
    with pytest.raises(ConfigError) as info:
        GRPOTrainer(model=str(model_dir), reward_funcs=none_for_all, args=args, train_dataset=rows).train()
    assert str(info.value).startswith(f"GRPOConfig({field}={value!r}): {cohort_key} is not valid")


def test_facade_still_accepts_reward_models_by_name_at_construction(tmp_path, monkeypatch):
    """The early check must not try to resolve a reward model's path or hub id (that loads weights)."""
    from cohort.trl_compat import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_steps=1, report_to="none", use_cpu=True, learning_rate=-1.0)
    with pytest.raises(ConfigError, match=r"GRPOConfig\(learning_rate=-1.0\)"):
        GRPOTrainer(model="some-org/policy", reward_funcs=["some-org/reward-model", none_for_all], args=args,
                    train_dataset=[{"prompt": "hi"}] * 4)
    # valid arguments: the constructor goes on to load the models, as TRL's does (the policy first), and a
    # policy that cannot be had offline is named
    args.learning_rate = 1e-6
    # offline as the hub library sees it: its constant is read at import, so the variable alone came too late and
    # every lookup waited for its network retries (70 s)
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="some-org/policy"):
        GRPOTrainer(model="some-org/policy", reward_funcs=["some-org/reward-model", none_for_all], args=args,
                    train_dataset=[{"prompt": "hi"}] * 4)


def test_facade_names_a_lone_surrogate_in_train_dataset_at_construction(tmp_path):
    from cohort.trl_compat import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2,
                      max_steps=1, report_to="none", use_cpu=True)
    rows = [{"prompt": "Say 1"}, {"prompt": [{"role": "user", "content": "Say \ud83d"}]}] * 2
    with pytest.raises(ConfigError, match=r"train_dataset: row 2, column 'prompt\[0\].content', character 5"):
        GRPOTrainer(model="some-org/policy", reward_funcs=none_for_all, args=args, train_dataset=rows)


# --------------------------------------------------------------------------------------------------- recipes
def test_recipe_with_a_recursive_alias_or_deep_nesting_is_one_error(tmp_path):
    from cohort.config import load_config

    (tmp_path / "loop.yaml").write_text("train: &t {max_steps: *t}\n")
    with pytest.raises(ConfigError, match=r"loop.yaml.*has an alias that refers to itself"):
        load_config(tmp_path / "loop.yaml")
    (tmp_path / "deep.yaml").write_text("train: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep.yaml.*nests too deeply"):
        load_config(tmp_path / "deep.yaml")
    (tmp_path / "ok.yaml").write_text("base: &b {max_steps: 3}\ntrain: *b\n")
    with pytest.raises(ConfigError, match="base"):  # aliases within the limit still work: 'base' is no section
        load_config(tmp_path / "ok.yaml")
    (tmp_path / "fine.yaml").write_bytes(b"\xef\xbb\xbftrain: {max_steps: 3}\n")  # UTF-8 with a byte-order mark
    assert load_config(tmp_path / "fine.yaml").train.max_steps == 3


# ------------------------------------------------------------------------------------------ data from anywhere
def test_lone_surrogates_are_named_for_every_kind_of_source(tmp_path):
    from cohort.data import load_prompt_dataset

    (tmp_path / "rows.json").write_text(json.dumps([{"prompt": "ok"}, {"prompt": "bad \ud800"}]))
    with pytest.raises(ConfigError, match=r"rows.json'.*row 2, column 'prompt', character 5 is a lone surrogate"):
        load_prompt_dataset(str(tmp_path / "rows.json"))
    rows = [{"prompt": [{"role": "user", "content": "fine"}]}, {"prompt": [{"role": "user", "content": "x\udfff"}]}]
    with pytest.raises(ConfigError, match=r"row 2, column 'prompt\[0\].content', character 2"):
        load_prompt_dataset(rows)
    with pytest.raises(ConfigError, match=r"row 1, column 'answer'"):
        load_prompt_dataset([{"prompt": "fine", "answer": "\udc80"}])
    (tmp_path / "latin1.csv").write_bytes(b"prompt,answer\nna\xefve,1\n")
    with pytest.raises(ConfigError, match=r"latin1.csv'.*line 2, column 3 is not UTF-8"):
        load_prompt_dataset(str(tmp_path / "latin1.csv"))


# -------------------------------------------------------------------------------- the CLI: paths and error lines
@pytest.fixture
def toy(tmp_path):
    from tests.helpers.toy_task import write_toy_workspace

    model_dir, data = write_toy_workspace(tmp_path)
    return [f"model.name_or_path={model_dir}", f"data.source={data}",
            "reward.funcs=[tests.helpers.toy_task:digit_share]", "train.max_steps=1", "train.prompts_per_step=2",
            "generation.num_generations=2", "generation.max_completion_length=4", "run.report_to=[jsonl]"]


def test_an_unwritable_run_directory_fails_before_the_model_loads(toy, tmp_path, capsys, monkeypatch):
    import os

    from cohort.cli import main
    from cohort.setup import policy as setup_policy

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(locked) else real_access(p, mode))
    loads = []
    monkeypatch.setattr(setup_policy, "load_policy", lambda *a, **k: loads.append(a))
    assert main(["train", *toy, f"run.output_dir={locked / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be written" in err and str(locked) in err, err
    assert not loads and not (locked / "run").exists()


def test_an_error_line_is_capped(toy, capsys):
    from cohort.cli import main

    assert main(["train", *toy, "train.device=" + "g" * 10_000]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 2100, len(err)
    assert err.rstrip().endswith("more characters)")


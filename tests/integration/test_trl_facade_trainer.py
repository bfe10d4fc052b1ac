"""The Trainer surface TRL scripts use: callbacks with TRL-like state, log_history, resume, save_model, evaluate,
push_to_hub offline, optimizers=, num_train_epochs, streaming datasets, reward models as objects/paths/hub ids."""

from __future__ import annotations

import logging

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, tiny_model, toy_rows
from transformers import AutoModelForCausalLM, TrainerCallback

from cohort import GRPOConfig, GRPOTrainer
from cohort.errors import ConfigError

datasets = pytest.importorskip("datasets", reason="needs datasets: pip install datasets")


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                max_completion_length=6, max_steps=2, learning_rate=1e-3, use_cpu=True, logging_steps=1,
                gradient_checkpointing=False, report_to="none")
    return GRPOConfig(**{**base, **kw})


def _trainer(tmp_path, tok=None, **kw):
    tok = tok or make_tiny_tokenizer()
    extra = {k: kw.pop(k) for k in ("train_dataset", "eval_dataset", "callbacks", "optimizers", "model")
             if k in kw}
    return GRPOTrainer(model=extra.pop("model", None) or tiny_model(tok), reward_funcs=digit_share,
                       args=_args(tmp_path, **kw), train_dataset=extra.pop("train_dataset", toy_rows()),
                       processing_class=tok, **extra)


class Recorder(TrainerCallback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def __getattribute__(self, name):
        if name.startswith("on_"):
            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step))
                if name == "on_step_end" and self.stop_at is not None and state.global_step >= self.stop_at:
                    control.should_training_stop = True
                return control
            return record
        return super().__getattribute__(name)


def test_callbacks_in_order_with_trl_state_and_log_history(tmp_path):
    rec = Recorder()
    trainer = _trainer(tmp_path, callbacks=[rec], save_steps=1)
    trainer.train()
    names = [e for e, _ in rec.events]
    one_step = ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_save"]
    assert names == ["on_init_end", "on_train_begin", "on_epoch_begin", *one_step, *one_step,
                     "on_epoch_end", "on_log", "on_train_end"]
    assert [s for e, s in rec.events if e == "on_save"] == [1, 2]
    history = trainer.state.log_history
    assert [row["step"] for row in history] == [1, 2, 2] and trainer.state.global_step == 2
    for row in history[:2]:
        assert {"loss", "reward", "reward_std", "reward_std_group_mean", "learning_rate", "grad_norm", "epoch",
                "sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/max"} <= set(row)
    assert history[1]["epoch"] == pytest.approx(2 * 2 / 50)  # 2 prompts a step, 50 rows
    assert {"train_runtime", "train_loss"} <= set(history[-1])
    assert [row["learning_rate"] for row in history[:2]] == pytest.approx([1e-3, 5e-4])  # linear: TRL's default


def test_should_training_stop_ends_after_the_step_with_a_checkpoint(tmp_path):
    trainer = _trainer(tmp_path, callbacks=[Recorder(stop_at=1)], max_steps=5)
    result = trainer.train()
    assert len(result.history) == 1
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()


def _clock(key: str) -> bool:
    """Metrics that measure wall-clock time (they differ between any two runs)."""
    return key.startswith(("time/", "train_runtime", "train_samples_per", "train_steps_per")) or key in (
        "step_time", "train_time", "tokens_per_second", "completions_per_second")


def test_resume_from_checkpoint_equals_an_uninterrupted_run(tmp_path):
    tok = make_tiny_tokenizer()
    full = _trainer(tmp_path / "a", tok, max_steps=4)
    full.train()
    part = _trainer(tmp_path / "b", tok, max_steps=4, callbacks=[Recorder(stop_at=2)])
    part.train()
    resumed = _trainer(tmp_path / "b", tok, max_steps=4)
    result = resumed.train(resume_from_checkpoint=True)
    assert len(result.history) == 2
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert [r["reward"] for r in full.result.history[2:]] == [r["reward"] for r in result.history]
    # TrainerState restored from the checkpoint: the same log_history (all but wall-clock values), step, epoch
    assert (resumed.state.global_step, resumed.state.epoch) == (full.state.global_step, full.state.epoch) == (4, 0.16)
    assert [r["step"] for r in resumed.state.log_history] == [r["step"] for r in full.state.log_history] == [1, 2, 3, 4, 4]
    for a, b in zip(full.state.log_history[:-1], resumed.state.log_history[:-1], strict=True):
        assert set(a) == set(b)
        assert {k: v for k, v in a.items() if not _clock(k)} == {k: v for k, v in b.items() if not _clock(k)}
    assert set(full.state.log_history[-1]) == set(resumed.state.log_history[-1])  # the closing row
    # from an explicit checkpoint folder, into another output_dir
    elsewhere = _trainer(tmp_path / "c", tok, max_steps=4)
    step2 = tmp_path / "b" / "run" / "checkpoints" / "step-000002"
    assert len(elsewhere.train(resume_from_checkpoint=str(step2)).history) == 2
    for a, b in zip(full.model.state_dict().values(), elsewhere.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="no such checkpoint"):
        _trainer(tmp_path / "c", tok).train(resume_from_checkpoint=str(tmp_path / "nowhere"))


def test_save_model_round_trips_through_from_pretrained(tmp_path):
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, a), b in zip(trainer.model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_evaluate_on_eval_dataset_and_its_splits(tmp_path):
    evald = datasets.DatasetDict({"a": datasets.Dataset.from_list(toy_rows(1)[:4]),
                                  "b": datasets.Dataset.from_list(toy_rows(1)[4:8])})
    trainer = _trainer(tmp_path, eval_dataset=evald, max_steps=1)
    out = trainer.evaluate()
    assert {"eval_a_reward", "eval_a_accuracy", "eval_b_reward"} <= set(out)
    assert trainer.state.log_history[-1]["eval_b_reward"] == out["eval_b_reward"]
    out = trainer.evaluate(evald["a"])
    assert {"eval_reward", "eval_accuracy", "eval_accuracy_ci_low", "eval_accuracy_ci_high"} <= set(out)


def test_eval_strategy_steps_evaluates_during_training(tmp_path):
    trainer = _trainer(tmp_path, eval_dataset=toy_rows(1)[:4], eval_strategy="steps", eval_steps=1, max_steps=2)
    trainer.train()
    assert any("eval_reward" in row for row in trainer.state.log_history)


def test_push_to_hub_offline_writes_a_local_folder(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = _trainer(tmp_path, max_steps=1, hub_model_id="me/tiny", push_to_hub=True)
    with caplog.at_level(logging.WARNING, logger="cohort.trl_compat"):
        trainer.train()  # push_to_hub=True: pushed when training ends, as TRL
    assert (tmp_path / "run" / "hub" / "me__tiny" / "config.json").is_file() and "HF_HUB_OFFLINE" in caplog.text
    assert trainer.push_to_hub().endswith("me__tiny")


def test_optimizers_argument_is_used(tmp_path):
    tok = make_tiny_tokenizer()
    model = tiny_model(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = _trainer(tmp_path, tok, model=model, optimizers=(opt, None), max_steps=1)
    trainer.train()
    assert trainer.optimizer is opt and trainer.lr_scheduler is not None


def test_num_train_epochs_derives_the_step_count(tmp_path):
    # 10 rows, 2 prompts per generation -> 5 generations (optimiser steps) an epoch
    trainer = _trainer(tmp_path, train_dataset=datasets.Dataset.from_list(toy_rows(1)), max_steps=-1,
                       num_train_epochs=1)
    result = trainer.train()
    assert len(result.history) == 5 and trainer.state.max_steps == 5
    assert trainer.state.log_history[-2]["epoch"] == pytest.approx(1.0)


def test_streaming_dataset_needs_max_steps(tmp_path):
    stream = datasets.Dataset.from_list(toy_rows()).to_iterable_dataset()
    with pytest.raises(ConfigError, match="max_steps"):
        _trainer(tmp_path, train_dataset=stream, max_steps=-1)
    trainer = _trainer(tmp_path, train_dataset=stream, max_steps=2)
    assert len(trainer._train_rows) == 4  # the prompts two steps draw
    assert len(trainer.train().history) == 2
    with pytest.raises(ConfigError, match="pass one split"):
        _trainer(tmp_path, train_dataset=datasets.DatasetDict({"train": datasets.Dataset.from_list(toy_rows())}))


def _reward_model(tok):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tok.pad_token_id)
    return LlamaForSequenceClassification(cfg)


def test_reward_model_as_object_path_or_hub_id(tmp_path, monkeypatch):
    tok = make_tiny_tokenizer()
    rm = _reward_model(tok)
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    for funcs, classes in (([rm], [tok]), ([str(tmp_path / "rm")], None)):
        trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=funcs, args=_args(tmp_path, max_steps=1),
                              train_dataset=toy_rows(), processing_class=tok, reward_processing_classes=classes)
        history = trainer.train().history
        assert history[0]["reward_std"] > 0  # a random reward model scores completions differently
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="HF_HUB_OFFLINE") as err:  # loaded at construction, as TRL does
        GRPOTrainer(model=tiny_model(tok), reward_funcs="someone/not-cached-reward-model",
                    args=_args(tmp_path, max_steps=1), train_dataset=toy_rows(), processing_class=tok)
    assert "local folder" in str(err.value)


def test_reward_functions_get_what_trl_passes(tmp_path):
    seen = []

    def spy(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, digit, **kwargs):
        seen.append(trainer_state.global_step)
        log_metric("spy/calls", 1.0)
        log_extra("digit_again", list(digit))
        assert len(prompts) == len(completions) == len(completion_ids) == len(digit) == 8
        return [0.0] * len(prompts)

    async def async_reward(completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step)] * len(completions)

    tok = make_tiny_tokenizer()
    # steps_per_generation=2: each generation makes 2 optimiser steps, so TRL's global_step goes 0, 2, 4
    trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=[spy, async_reward],
                          args=_args(tmp_path, max_steps=6, steps_per_generation=2, per_device_train_batch_size=4),
                          train_dataset=toy_rows(), processing_class=tok)
    result = trainer.train()
    assert seen == [0, 2, 4]
    assert [r["rewards/async_reward/mean"] for r in result.history] == [0.0, 2.0, 4.0]
    assert all(r["spy/calls"] == 1.0 for r in trainer.state.log_history[:3])


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}mode {{ mode | default('plain') }}:{% endif %}")
    rows = [{"prompt": [{"role": "user", "content": f"Say {d}"}], "digit": str(d)} for d in range(4)]
    trainer = _trainer(tmp_path, tok, train_dataset=rows, max_steps=1, chat_template_kwargs={"mode": "7"})
    trainer.train()
    text = tok.decode(trainer._comp.train_data.batch([0]).prompt_ids[0])
    assert text.endswith("mode 7:"), text


def test_model_init_kwargs_disable_dropout_and_eval_on_start(tmp_path):
    from tests.helpers.toy_task import write_toy_workspace

    model_dir, _ = write_toy_workspace(tmp_path / "ws")
    args = _args(tmp_path, max_steps=1, disable_dropout=True, eval_on_start=True,
                 model_init_kwargs={"dtype": "float32", "revision": "main", "attn_implementation": None})
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digit_share, args=args, train_dataset=toy_rows(),
                          eval_dataset=toy_rows(1)[:4])
    trainer.train()
    assert trainer.config.model.dtype == "float32"
    assert all(m.p == 0.0 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))
    assert "eval_reward" in trainer.state.log_history[0]  # evaluated before the first step
    with pytest.raises(ConfigError, match="revision"):
        GRPOTrainer(model=str(model_dir), reward_funcs=digit_share, train_dataset=toy_rows(),
                    args=_args(tmp_path, model_init_kwargs={"revision": "v2"}))


def test_save_strategy_no_writes_no_checkpoint(tmp_path):
    rec = Recorder()
    trainer = _trainer(tmp_path, callbacks=[rec], save_strategy="no", max_steps=2)
    trainer.train()
    assert not list((tmp_path / "run").glob("checkpoints/step-*")), "save_strategy='no' wrote a checkpoint"
    assert "on_save" not in [e for e, _ in rec.events]
    trainer.save_model()  # as in TRL, an explicit save_model() still saves
    assert (tmp_path / "run" / "config.json").is_file()
    with pytest.raises(ConfigError, match=r"no checkpoint in .* to resume from"):  # TRL raises too
        _trainer(tmp_path, save_strategy="no", max_steps=3).train(resume_from_checkpoint=True)


def test_saved_trainer_state_is_strict_json_and_round_trips_non_finite_metrics():
    import json
    import math

    from cohort.trl_compat.callbacks import _from_json, _to_json

    history = [{"loss": float("nan"), "reward": 0.5, "grad_norm": float("inf"), "step": 1}, {"note": "x"}]
    text = json.dumps(_to_json(history), allow_nan=False)  # what cohort.checkpointing requires
    back = _from_json(json.loads(text))
    assert math.isnan(back[0]["loss"]) and back[0]["grad_norm"] == math.inf and back[0]["reward"] == 0.5
    assert back[1] == {"note": "x"}


def test_a_logged_row_averages_the_steps_since_the_previous_one_as_trl(tmp_path):
    # logging_steps=2 over 3 steps: a row at step 2 (the mean of steps 1-2; grad_norm and learning_rate of step 2,
    # as transformers logs them), and the closing row carries step 3's metrics (TRL's GRPOTrainer.log merges the
    # metrics gathered since the last row into it), without loss / grad_norm / learning_rate
    trainer = _trainer(tmp_path, max_steps=3, logging_steps=2, learning_rate=1e-2)
    steps = trainer.train().history
    rows = trainer.state.log_history
    assert [r["step"] for r in rows] == [2, 3]
    for key in ("reward", "loss", "entropy", "completions/mean_length"):
        assert rows[0][key] == pytest.approx((steps[0][key] + steps[1][key]) / 2), key
    assert rows[0]["grad_norm"] == steps[1]["grad_norm"] and rows[0]["learning_rate"] == steps[1]["learning_rate"]
    assert rows[1]["reward"] == pytest.approx(steps[2]["reward"]) and "train_runtime" in rows[1]
    assert not {"loss", "grad_norm", "learning_rate"} & set(rows[1])
    assert rows[1]["train_loss"] == pytest.approx(sum(s["loss"] for s in steps) / 3)


class AskAtStep1(TrainerCallback):
    """Asks for a checkpoint and an evaluation at step 1, as a TRL user's callback would."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            control.should_save = control.should_evaluate = True
        return control


def test_a_callbacks_should_save_and_should_evaluate_are_honoured(tmp_path):
    rec = Recorder()
    trainer = _trainer(tmp_path, callbacks=[AskAtStep1(), rec], max_steps=3, save_steps=500, eval_steps=100,
                       eval_strategy="steps", eval_dataset=toy_rows(1)[:4])
    trainer.train()
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()
    assert [s for e, s in rec.events if e == "on_save"] == [1, 3]  # asked for, and the end (save_strategy steps)
    assert [s for e, s in rec.events if e == "on_evaluate"] == [1, 3]  # asked for, and the end
    assert [row["step"] for row in trainer.state.log_history if "eval_reward" in row] == [1, 3]

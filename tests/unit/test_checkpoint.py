"""Checkpoints: Hugging Face loadable, exact state round trip, atomic under a crash, pruning."""

import json
import random

import numpy as np
import pytest
import torch
from tests.helpers.tiny_models import tiny_llama
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from cohort import checkpointing as ckpt
from cohort.checkpointing import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from cohort.errors import ConfigError


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(["a", "b", "c", "d", "e"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def train_objects(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    for _ in range(2):  # populate Adam moments and advance the schedule
        model(torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_round_trip_restores_weights_optimizer_scheduler_rng_and_state(tmp_path):
    model = tiny_llama(0)
    opt, sched = train_objects(model)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(
        tmp_path,
        7,
        model=model,
        tokenizer=tiny_tokenizer(),
        optimizer=opt,
        scheduler=sched,
        trainer_state={"data_position": 42, "metrics_rows": 7},
    )
    expected_draw = draw()
    assert path == tmp_path / "checkpoints" / "step-000007"
    assert latest_checkpoint(tmp_path) == path
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000007"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "optimizer.pt",
        "scheduler.pt",
        "rng.pt",
    ):
        assert (path / name).is_file(), name

    fresh = tiny_llama(99)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 3))
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    state = load_checkpoint(path, model=fresh, optimizer=opt2, scheduler=sched2)

    assert state["step"] == 7 and state["data_position"] == 42 and state["metrics_rows"] == 7
    assert draw() == expected_draw
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert sched2.last_epoch == sched.last_epoch == 2
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        sa, sb = opt.state[p], opt2.state[q]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) == 2.0


def test_checkpoint_loads_with_from_pretrained_and_tokenizer(tmp_path):
    model = tiny_llama(0, tie=True)
    path = save_checkpoint(tmp_path, 1, model=model, tokenizer=tiny_tokenizer(), trainer_state={})
    loaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.tensor([[2, 3, 4]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert PreTrainedTokenizerFast.from_pretrained(path)("a b e")["input_ids"] == [2, 3, 6]
    # in-place load of a tied model: lm_head is not in the file but follows the embedding
    fresh = tiny_llama(5, tie=True)
    load_checkpoint(path, model=fresh, restore_rng=False)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_crash_mid_write_keeps_previous_checkpoint_latest(tmp_path, monkeypatch):
    model = tiny_llama(0)
    opt, sched = train_objects(model)
    good = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched, trainer_state={"x": 1})

    real_save = torch.save

    def failing_save(obj, f, *a, **k):
        if str(f).endswith("scheduler.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    # a CheckpointError naming the folder and the cause (the CLI's exit-2 message, not a traceback)
    with pytest.raises(CheckpointError, match=r"step-000002.*OSError: disk full \(simulated\)"):
        save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched, trainer_state={"x": 2})
    monkeypatch.undo()

    assert latest_checkpoint(tmp_path) == good
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert load_checkpoint(good, model=tiny_llama(3), restore_rng=False)["x"] == 1


def test_half_written_directories_are_never_picked_up(tmp_path):
    model = tiny_llama(0)
    good = save_checkpoint(tmp_path, 3, model=model, trainer_state={})
    root = tmp_path / "checkpoints"
    # a process killed mid-save leaves a hidden temporary; a step dir without trainer_state.json is incomplete
    (root / ".tmp-step-000004-dead").mkdir()
    (root / ".tmp-step-000004-dead" / "trainer_state.json").write_text("{}")
    (root / "step-000005").mkdir()
    (root / "latest").write_text("step-000005\n")  # pointer at an incomplete dir: ignored
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").unlink()
    assert latest_checkpoint(tmp_path) == good
    save_checkpoint(tmp_path, 6, model=model, trainer_state={})
    assert not (root / ".tmp-step-000004-dead").exists()  # swept by the next save


def test_keep_last_prunes_oldest_and_resave_same_step(tmp_path):
    model = tiny_llama(0)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model=model, trainer_state={"v": step}, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000003", "step-000004"]
    again = save_checkpoint(tmp_path, 4, model=model, trainer_state={"v": 40}, keep_last=2)
    assert json.loads((again / "trainer_state.json").read_text())["v"] == 40
    assert latest_checkpoint(tmp_path) == again


def test_bad_inputs_give_clear_errors(tmp_path):
    model = tiny_llama(0)
    with pytest.raises(ConfigError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, model=model, trainer_state={}, keep_last=0)
    with pytest.raises(ConfigError, match=r"\['bad'\]"):
        save_checkpoint(tmp_path, 1, model=model, trainer_state={"bad": torch.zeros(2)})
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ConfigError, match="not a complete cohort checkpoint"):
        load_checkpoint(tmp_path, model=model)
    path = save_checkpoint(tmp_path, 1, model=model, trainer_state={})
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ckpt.CheckpointError, match=r"no optimizer\.pt"):
        load_checkpoint(path, model=model, optimizer=opt)
    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
        )
    )
    with pytest.raises(ckpt.CheckpointError, match="does not fit the model"):
        load_checkpoint(path, model=other)

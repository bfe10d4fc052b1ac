"""Faults a long run meets, each with a clear outcome and nothing corrupted (issue 14):

- a non-finite loss skips the optimiser update (weights and Adam's state untouched, counted in
  `skipped_updates`); `train.max_nonfinite_updates` of them in a row stop the run with exit code 2;
- a save that raises OSError halfway is a CheckpointError naming the folder and the cause, and the last good
  checkpoint and `latest` stay loadable;
- a truncated or garbage checkpoint file is a CheckpointError naming the file;
- `run.save_only_model` checkpoints hold no optimizer state, their size is logged, and --resume continues
  with a line saying Adam restarts;
- samples.jsonl stores a conversational prompt as JSON messages.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, tiny_model, toy_rows
from tests.integration.test_trainer_learns import toy_components
from tests.integration.test_trainer_learns import toy_config as _toy_config

from cohort import checkpointing as ckpt
from cohort.checkpointing import CheckpointError, atomic
from cohort.cli import main
from cohort.data import load_prompt_dataset
from cohort.rewards import RewardRunner
from cohort.run.callbacks import Callback, Decision
from cohort.run.logging import read_jsonl
from cohort.setup import build_components
from cohort.trainer import train
from cohort.update import NonFiniteUpdateError


def toy_config(tmp_path, steps: int):
    """The toy job, smaller: these tests check what happens around an update, not that it learns."""
    cfg = _toy_config(tmp_path, steps)
    cfg.train.prompts_per_step, cfg.generation.num_generations, cfg.generation.max_completion_length = 2, 4, 6
    return cfg


@functools.cache
def _tokenizer():
    return make_tiny_tokenizer()


def _poison_loss(comp, bad_calls: set[int]):
    """Components whose loss is NaN on the given calls of the loss function (counted from 1)."""
    real, calls = comp.loss_fn, []

    def loss_fn(inputs):
        out = real(inputs)
        calls.append(len(calls) + 1)
        if len(calls) in bad_calls:
            out.loss = out.loss * float("nan")
        return out

    return dataclasses.replace(comp, loss_fn=loss_fn)


class _OnLog(Callback):
    """Calls `fn()` after each step's metrics are logged."""

    def __init__(self, fn):
        self.fn = fn

    def on_log(self, step, metrics):
        self.fn()
        return Decision.CONTINUE


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(params=["adamw", "fused-adamw"])
def adam_kind(request, monkeypatch):
    """Both skip paths: the host decides (torch's AdamW, as on the CPU) or the fused AdamW skips on the device
    through found_inf (the GPU's optimiser; torch has a fused CPU AdamW too)."""
    if request.param == "fused-adamw":
        class FusedAdamW(torch.optim.AdamW):
            def __init__(self, params, **kwargs):
                super().__init__(params, **{**kwargs, "fused": True})

        monkeypatch.setattr(torch.optim, "AdamW", FusedAdamW)
    return request.param


def test_nan_loss_skips_the_update_and_counts_it(tmp_path, adam_kind):
    from cohort.update import fused_adam_of

    cfg = toy_config(tmp_path, steps=3)
    comp = toy_components(cfg)
    comp = _poison_loss(comp, {2})  # one micro-batch per update: call 2 is step 2's only update
    snapshots = []

    def hook():
        snapshots.append(_params(comp.policy))

    assert (fused_adam_of(comp.optimizer) is not None) == (adam_kind == "fused-adamw")
    result = train(cfg, comp, callbacks=[_OnLog(hook)])
    assert [m["skipped_updates"] for m in result.history] == [0.0, 1.0, 0.0]
    w1, w2, _ = snapshots
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "a skipped update changed the weights"
    assert all(torch.isfinite(p).all() for p in comp.policy.parameters())
    assert math.isnan(result.history[1]["grad_norm"]) or result.history[1]["grad_norm"] is None
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["skipped_updates"] for r in rows] == [0, 1, 0]
    assert all(p.grad is None for p in comp.policy.parameters())  # gradients zeroed


def test_adam_state_is_untouched_by_a_skipped_update(tmp_path, adam_kind):
    cfg = toy_config(tmp_path, steps=2)
    comp = _poison_loss(toy_components(cfg), {2})
    states = []
    train(cfg, comp, callbacks=[_OnLog(lambda: states.append(
        {k: v.clone() if torch.is_tensor(v) else v for k, v in
         next(iter(comp.optimizer.state_dict()["state"].values())).items()}))])
    first, second = states
    assert first.keys() == second.keys()
    assert all(torch.equal(torch.as_tensor(first[k]), torch.as_tensor(second[k])) for k in first)


def test_nonfinite_updates_in_a_row_stop_the_run(tmp_path, adam_kind):
    cfg = toy_config(tmp_path, steps=6)
    cfg.train.max_nonfinite_updates = 2
    cfg.run.save_steps = 1
    comp = toy_components(cfg)
    comp = _poison_loss(comp, {2, 3})  # steps 2 and 3: two in a row
    with pytest.raises(NonFiniteUpdateError) as err:
        train(cfg, comp)
    message = str(err.value)
    assert "step 3" in message and "train.max_nonfinite_updates=2" in message
    # the last checkpoint is step 2's (its update skipped), with weights equal to step 1's
    assert ckpt.latest_checkpoint(tmp_path / "run").name == "step-000002"


def test_nonfinite_stop_is_exit_code_2_from_the_cli(tmp_path, capsys, monkeypatch):
    from tests.helpers.toy_task import write_toy_workspace

    import cohort.update as update

    model_dir, toy = write_toy_workspace(tmp_path / "ws")
    real = update.PolicyUpdater._reduce_and_clip
    monkeypatch.setattr(update.PolicyUpdater, "_reduce_and_clip", lambda self: real(self) * float("inf"))
    code = main(["train", f"model.name_or_path={model_dir}", f"data.source={toy}",
                 "reward.funcs=[tests.helpers.toy_task:digit_share]", "train.max_steps=4", "train.prompts_per_step=2",
                 "generation.num_generations=2", "generation.max_completion_length=4",
                 f"run.output_dir={tmp_path / 'run'}", "run.report_to=[jsonl]"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "step 3" in err and "train.max_nonfinite_updates=3" in err and "Traceback" not in err


def test_max_nonfinite_updates_is_validated():
    from cohort.config import CohortConfig
    from cohort.errors import ConfigError

    cfg = CohortConfig()
    cfg.train.max_nonfinite_updates = 0
    with pytest.raises(ConfigError, match=r"train\.max_nonfinite_updates=0"):
        cfg.validate()


# ------------------------------------------------------------------------------------------ checkpoints
def _save(run_dir, step, model, optimizer=None):
    return ckpt.save_checkpoint(run_dir, step, model=model, optimizer=optimizer, trainer_state={"k": step})


def _model_and_optimizer():
    model = tiny_model(_tokenizer())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    return model, optimizer


def test_save_failing_halfway_is_a_clear_error_and_keeps_latest(tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    good = _save(tmp_path, 1, model, optimizer)
    real_save = torch.save

    def half_then_full(obj, file, *args, **kwargs):  # write half of optimizer.pt, then the disk is full
        if str(file).endswith(ckpt.OPTIMIZER_FILE):
            real_save(obj, file, *args, **kwargs)
            with open(file, "r+b") as f:
                f.truncate(max(1, f.seek(0, 2) // 2))
            raise OSError(28, "No space left on device")
        return real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", half_then_full)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 2, model, optimizer)
    message = str(err.value)
    assert "step-000002" in message and "No space left on device" in message
    assert str(good) in message and "`latest` are unchanged" in message
    monkeypatch.setattr(torch, "save", real_save)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # no temporary left
    fresh, fresh_opt = _model_and_optimizer()
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), model=fresh, optimizer=fresh_opt)["k"] == 1


def test_permission_error_while_publishing_is_a_clear_error(tmp_path, monkeypatch):
    model, optimizer = _model_and_optimizer()
    _save(tmp_path, 1, model, optimizer)
    monkeypatch.setattr(atomic, "_move_into_place", lambda tmp, final: (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", str(final))))
    with pytest.raises(CheckpointError, match=r"step-000002.*Permission denied"):
        _save(tmp_path, 2, model, optimizer)
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000001"


def _corrupt(kind: str, path):
    if kind == "truncated model.safetensors":
        target = path / "model.safetensors"
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif kind == "garbage optimizer.pt":
        target = path / "optimizer.pt"
        target.write_bytes(b"this is not a torch file" * 10)
    elif kind == "truncated rng.pt":
        target = path / "rng.pt"
        target.write_bytes(target.read_bytes()[:100])
    elif kind == "garbage trainer_state.json":
        target = path / "trainer_state.json"
        target.write_text("{not json")
    return target


@pytest.mark.parametrize("kind", ["truncated model.safetensors", "garbage optimizer.pt", "truncated rng.pt",
                                  "garbage trainer_state.json"])
def test_corrupt_checkpoint_file_names_the_file(tmp_path, kind):
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, 1, model, optimizer)
    target = _corrupt(kind, path)
    fresh, fresh_opt = _model_and_optimizer()
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, model=fresh, optimizer=fresh_opt)
    assert str(target) in str(err.value) and "truncated or damaged" in str(err.value)


def test_optimizer_file_with_code_is_refused_by_the_safe_loader(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = _save(tmp_path, 1, model, optimizer)
    torch.save({"state": {}, "param_groups": [], "evil": _Evil()}, path / "optimizer.pt")
    fresh, fresh_opt = _model_and_optimizer()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt"):
        ckpt.load_checkpoint(path, model=fresh, optimizer=fresh_opt)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


# ------------------------------------------------------------------------------ save_only_model, samples
def test_save_only_model_checkpoints_and_resume(tmp_path):
    lines: list[str] = []
    cfg = toy_config(tmp_path, steps=2)
    cfg.run.save_only_model = True
    train(cfg, toy_components(cfg), echo=lines.append)
    latest = ckpt.latest_checkpoint(tmp_path / "run")
    assert not (latest / "optimizer.pt").exists() and not ckpt.has_optimizer_state(latest)
    assert any(line.startswith("checkpoint step-000002:") and "on disk" in line and "weights only" in line
               for line in lines), lines
    resumed = toy_config(tmp_path, steps=3)
    resumed.run.resume = True
    lines.clear()
    train(resumed, toy_components(resumed), echo=lines.append)
    assert any("no optimizer state" in line and "restart from zero" in line for line in lines), lines
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_checkpoint_size_is_logged_with_its_optimizer_share(tmp_path):
    lines: list[str] = []
    cfg = toy_config(tmp_path, steps=1)
    train(cfg, toy_components(cfg), echo=lines.append)
    assert any(line.startswith("checkpoint step-000001:") and "of it optimizer state" in line for line in lines)


def test_samples_jsonl_holds_conversational_prompts_as_messages(tmp_path):
    cfg = toy_config(tmp_path, steps=1)
    cfg.run.log_completions = True
    tok = make_tiny_tokenizer()
    rows = [{"prompt": [{"role": "system", "content": "Answer with digits."},
                        {"role": "user", "content": r["prompt"]}], "digit": r["digit"]} for r in toy_rows(1)]
    data = load_prompt_dataset(rows).encode(tok, 64)
    comp = build_components(cfg, policy=tiny_model(tok), tokenizer=tok,
                            reward_runner=RewardRunner([digit_share]), train_data=data)
    train(cfg, comp)
    lines = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    assert len(lines) == cfg.completions_per_step
    for line in lines:
        row = json.loads(line)
        assert isinstance(row["prompt"], list) and [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert row["prompt"][1]["content"].startswith("Say the digit")


def test_truncated_dcp_shard_names_the_file(tmp_path):
    cfg = toy_config(tmp_path, steps=1)
    cfg.train.sharding = "fsdp"  # a world of one: the checkpoint is written by DCP
    train(cfg, toy_components(cfg))
    path = ckpt.latest_checkpoint(tmp_path / "run")
    shards = sorted((path / "dcp").glob("*.distcp"))
    assert shards
    shards[0].write_bytes(shards[0].read_bytes()[: shards[0].stat().st_size // 3])
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(path, model=tiny_model(_tokenizer()), restore_rng=False)
    assert shards[0].name in str(err.value) and "truncated or damaged" in str(err.value), str(err.value)

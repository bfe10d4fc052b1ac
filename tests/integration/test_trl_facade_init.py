"""What GRPOTrainer's constructor loads, as TRL's does: `trainer.model` is the nn.Module training updates (TRL's
test pattern: clone `trainer.model.named_parameters()` before `train()`, compare after), the processing class
(loaded from the model's `config._name_or_path` when only a model object is given), the reference model with
beta != 0, and a model that needs remote code fails in the constructor without trust_remote_code."""

from __future__ import annotations

import json

import pytest
import torch
from tests.helpers.toy_task import toy_rows, write_toy_workspace
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from cohort import GRPOConfig, GRPOTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder, _ = write_toy_workspace(tmp_path_factory.mktemp("tiny"))
    return folder


def distinct_chars(completions, **kwargs):
    """Varies within every group (the toy digit reward is 0 for a random model: no advantage, no update)."""
    return [float(len(set(c))) for c in completions]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, num_generations=4,
                max_completion_length=6, max_steps=1, learning_rate=1e-2, use_cpu=True, logging_steps=1,
                gradient_checkpointing=False, report_to="none", save_strategy="no")
    return GRPOConfig(**{**base, **kw})


def _trainer(model, tmp_path, **kw):
    return GRPOTrainer(model=model, reward_funcs=distinct_chars, args=_args(tmp_path, **kw), train_dataset=toy_rows())


def test_trl_pattern_parameters_change_through_the_model_taken_before_train(model_dir, tmp_path):
    trainer = _trainer(str(model_dir), tmp_path)
    assert isinstance(trainer.model, torch.nn.Module)
    assert isinstance(trainer.processing_class, PreTrainedTokenizerBase)
    model = trainer.model
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.model is model  # the object built at construction is the one trained
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, previous[n])]
    assert changed, "no parameter changed after train()"


def test_model_object_without_processing_class_gets_its_tokenizer(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = _trainer(model, tmp_path)
    assert trainer.model is model
    assert isinstance(trainer.processing_class, PreTrainedTokenizerBase)
    assert len(trainer.processing_class) == model.config.vocab_size
    trainer.train()


def test_freezing_a_parameter_between_init_and_train_takes_effect(model_dir, tmp_path):
    trainer = _trainer(str(model_dir), tmp_path)
    frozen = trainer.model.model.layers[0].self_attn.q_proj.weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    previous = {n: p.clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert torch.equal(frozen, before)
    assert any(not torch.equal(p, previous[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_reference_model_built_at_construction_when_beta_is_not_zero(model_dir, tmp_path):
    with_kl = _trainer(str(model_dir), tmp_path, beta=0.04, loss_type="grpo")
    assert isinstance(with_kl.ref_model, torch.nn.Module) and with_kl.ref_model is not with_kl.model
    assert not any(p.requires_grad for p in with_kl.ref_model.parameters())
    assert _trainer(str(model_dir), tmp_path).ref_model is None  # beta=0: TRL's default, no reference


def test_remote_code_model_without_trust_remote_code_fails_in_the_constructor(model_dir, tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="cohort_remote_test", architectures=["RemoteForCausalLM"],
                  auto_map={"AutoConfig": "configuration_remote.RemoteConfig",
                            "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        _trainer(str(folder), tmp_path)

"""The TRL surface the facade adds for code written against `trl.GRPOTrainer` (issue 36): TRL's loss helpers
(`get_high_entropy_mask`, `get_off_policy_mask`), `reward_func_names`, `reward_weights`, `aux_loss_enabled`,
`_logs`, a settable `accelerator`, the data loaders, environment-owned data without `train_dataset`,
`evaluate()`'s `eval_loss`, TRL's errors and warnings with TRL's wording, and the data path without the
`datasets` package or reasoning-gym. Each behaviour is checked with the values TRL gives."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace
from unittest.mock import Mock

import huggingface_hub
import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import toy_rows, write_toy_workspace
from transformers import AutoModelForSequenceClassification, AutoTokenizer, MixtralConfig, MixtralForCausalLM
from transformers.trainer_pt_utils import AcceleratorConfig

from cohort import GRPOConfig, GRPOTrainer
from cohort.trl_compat.rows import prompt_rows

Dataset = pytest.importorskip("datasets", reason="the TRL facade's dataset paths: pip install datasets").Dataset
_peft = pytest.importorskip("peft", reason="needs peft (LoRA, prompt tuning): pip install peft")
LoraConfig, PromptTuningConfig = _peft.LoraConfig, _peft.PromptTuningConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder, _ = write_toy_workspace(tmp_path_factory.mktemp("tiny"))
    return folder


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=4, max_steps=1, learning_rate=1e-2, use_cpu=True, logging_steps=1,
                gradient_checkpointing=False, report_to="none", save_strategy="no")
    return GRPOConfig(**{**base, **kw})


def _trainer(model_dir, tmp_path, reward_funcs=distinct_chars, **kw):
    return GRPOTrainer(model=str(model_dir), reward_funcs=reward_funcs, args=_args(tmp_path, **kw),
                       train_dataset=toy_rows(1))


# ------------------------------------------------------------------------------------------ loss helpers
ENTROPIES = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])


def _entropy_mask(threshold, mask=MASK):
    trainer = Mock(spec=GRPOTrainer)  # as TRL's own test calls it: the method on a mock with a 1-process accelerator
    trainer.accelerator = SimpleNamespace(num_processes=1)
    return GRPOTrainer.get_high_entropy_mask(trainer, ENTROPIES, mask, threshold)


def test_high_entropy_mask_keeps_the_tokens_at_or_above_the_quantile_of_unpadded_entropies():
    # 10 unpadded values 0.1..1.0: the 0.8 quantile is 0.82, so 0.9 and 1.0 (the padded 1.1, 1.2 never count)
    assert _entropy_mask(0.8).tolist() == [[False] * 6, [False, False, True, True, False, False]]
    assert _entropy_mask(0.0).tolist() == MASK.bool().tolist()
    assert _entropy_mask(1.0).tolist() == [[False] * 6, [False, False, False, True, False, False]]
    assert not _entropy_mask(0.5, mask=torch.zeros_like(MASK)).any()
    assert _entropy_mask(0.8).dtype == torch.bool


def test_off_policy_mask_drops_negative_advantage_sequences_far_from_the_sampler():
    logps = torch.zeros(3, 4)
    logps[0], logps[1], logps[2] = -2.0, -0.5, -2.0  # KL from the sampler (logp 0): 2, 0.5, 2
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    out = GRPOTrainer.get_off_policy_mask(advantages, logps, torch.zeros(3, 4), torch.ones(3, 4), 1.0)
    assert out.tolist() == [[1.0], [1.0], [0.0]]
    padded = torch.tensor([[-2.0, -2.0, -1e4, 1e4]])  # padding never enters the mean KL
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    assert GRPOTrainer.get_off_policy_mask(torch.tensor([[-1.0]]), padded, torch.zeros(1, 4), mask, 1.0).item() == 0.0


# ------------------------------------------------------------------------------------------- attributes
def test_trl_attributes_reward_names_weights_accelerator_and_loaders(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, reward_funcs=[distinct_chars, distinct_chars],
                       reward_weights=[0.7, 0.3], dataloader_num_workers=2)
    assert trainer.reward_func_names == ["distinct_chars", "distinct_chars"]
    assert trainer.reward_weights.tolist() == pytest.approx([0.7, 0.3])
    assert not trainer.aux_loss_enabled  # a dense Llama: no router
    assert trainer.accelerator.num_processes == 1
    replacement = SimpleNamespace(num_processes=1)
    trainer.accelerator = replacement  # TRL's tests and wrappers set it
    assert trainer.accelerator is replacement
    assert trainer.get_train_dataloader().num_workers == 2
    assert isinstance(trainer.args.accelerator_config, AcceleratorConfig)
    assert trainer._logs["extra"] == {}  # nothing logged before training


def test_aux_loss_enabled_for_a_model_with_routers(tmp_path):
    tok = make_tiny_tokenizer()
    cfg = MixtralConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=2, num_experts_per_tok=1,
                        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = MixtralForCausalLM(cfg)
    trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=distinct_chars,
                          args=_args(tmp_path), train_dataset=toy_rows(1))
    assert trainer.aux_loss_enabled
    trainer.args.router_aux_loss_coef = 0.0
    assert not trainer.aux_loss_enabled


def _hub_cache(root, repo_id):
    """A Hugging Face hub cache holding `repo_id` (refs/main -> one snapshot folder), as a download leaves it."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)
    return repo / "snapshots" / ("a" * 40)


def test_reward_models_by_name_get_trl_names_and_processing_classes(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    reward_dir = _hub_cache(tmp_path / "hub", "org/my-reward")  # a hub id: named after it, not the snapshot
    AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1).save_pretrained(reward_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.save_pretrained(reward_dir)
    trainer = _trainer(model_dir, tmp_path, reward_funcs=["org/my-reward", distinct_chars])
    assert trainer.reward_func_names == ["my-reward", "distinct_chars"]
    assert trainer.config.reward.funcs[0].name == "my-reward"  # its metrics: rewards/my-reward/mean
    assert trainer.reward_processing_classes[0] is not None and trainer.reward_processing_classes[1] is None
    with pytest.raises(ValueError, match="must match"):
        GRPOTrainer(model=str(model_dir), reward_funcs=[str(reward_dir), distinct_chars], args=_args(tmp_path),
                    train_dataset=toy_rows(1), reward_processing_classes=tok)


# --------------------------------------------------------------------------------- TRL's checks and texts
def test_trl_errors_before_anything_loads(model_dir, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=str(model_dir), args=_args(tmp_path), train_dataset=toy_rows(1))
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, args=_args(tmp_path))
    with pytest.raises(ValueError, match=r"Number of reward weights \(1\) must match"):
        _trainer(model_dir, tmp_path, reward_weights=[1.0], reward_funcs=[distinct_chars, distinct_chars])


def test_iterable_datasets_need_dispatch_batches_off_and_one_worker(model_dir, tmp_path):
    stream = Dataset.from_list(toy_rows(1)).to_iterable_dataset()
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, train_dataset=stream,
                    args=_args(tmp_path, accelerator_config={"dispatch_batches": True}))
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, train_dataset=stream,
                          args=_args(tmp_path, dataloader_num_workers=3))
    assert trainer.args.accelerator_config.dispatch_batches is False
    assert trainer.args.dataloader_num_workers == 0


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_sampling_with_a_token_summed_loss_warns_as_trl(model_dir, tmp_path, caplog, loss_type):
    with caplog.at_level(logging.WARNING):
        _trainer(model_dir, tmp_path, importance_sampling_level="sequence", loss_type=loss_type)
    assert ("weights each sequence by its completion length" in caplog.text) == (loss_type != "grpo")


class _Env:
    def reset(self, **kwargs):
        return "Say the digit 7 many times"


def test_environment_owned_data_without_train_dataset(model_dir, tmp_path):
    with pytest.raises(ValueError, match="max_steps"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, environment_factory=_Env,
                    args=_args(tmp_path, max_steps=-1))
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, environment_factory={"a": _Env, "b": _Env},
                    args=_args(tmp_path))
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, environment_factory=_Env,
                          args=_args(tmp_path, max_steps=2))
    assert trainer._train_rows == [{"prompt": [{"role": "user", "content": ""}]}]  # one generation round's prompts
    assert trainer.config.train.max_steps == 2


# ------------------------------------------------------------------------------- training and evaluation
def test_all_none_rewards_warn_as_trl_and_training_goes_on(model_dir, tmp_path, caplog):
    def always_none(completions, **kwargs):
        return [None] * len(completions)

    trainer = _trainer(model_dir, tmp_path, reward_funcs=always_none)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    assert trainer.state.global_step == 1


def test_logs_extra_and_evaluate_eval_loss(model_dir, tmp_path):
    def with_extra(completions, log_extra, **kwargs):
        log_extra("head", [c[:2] for c in completions])
        return distinct_chars(completions)

    trainer = _trainer(model_dir, tmp_path, reward_funcs=with_extra, log_completions=True)
    trainer.train()
    assert len(trainer._logs["extra"]["head"]) == 4 and len(trainer._logs["completion"]) == 4
    metrics = trainer.evaluate(eval_dataset=toy_rows(1)[:2])
    assert "eval_loss" in metrics and torch.isfinite(torch.tensor(metrics["eval_loss"]))
    split = trainer.evaluate(eval_dataset={"a": toy_rows(1)[:2], "b": toy_rows(1)[2:4]})
    assert {"eval_a_loss", "eval_b_loss"} <= set(split)


# ------------------------------------------------------------------------------------ optional packages
def test_prompt_rows_without_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    assert prompt_rows([{"prompt": "a"}], None, "train_dataset") == [{"prompt": "a"}]
    assert prompt_rows({"prompt": ["a", "b"]}, None, "train_dataset") == [{"prompt": "a"}, {"prompt": "b"}]


def test_the_facade_needs_no_reasoning_gym(model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    trainer = _trainer(model_dir, tmp_path)
    assert not str(getattr(trainer.config.data.source, "__name__", trainer.config.data.source)).startswith(
        "reasoning_gym")
    assert trainer.config.data.source() == trainer._train_rows


# ------------------------------------------------------------------- TRL settings cohort implements here
def test_sync_ref_model_mixes_the_policy_into_the_reference(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"`sync_ref_model=True` while `beta=0\.0`"):
        _trainer(model_dir, tmp_path, sync_ref_model=True)
    trainer = _trainer(model_dir, tmp_path, beta=0.1, loss_type="grpo", sync_ref_model=True, ref_model_sync_steps=1,
                       ref_model_mixup_alpha=0.25)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    reference = dict(trainer.ref_model.named_parameters())
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, start[n])]
    assert moved
    for name in moved:  # after the one step: 0.25 x policy + 0.75 x the reference (the initial weights)
        expected = 0.25 * dict(trainer.model.named_parameters())[name] + 0.75 * start[name]
        torch.testing.assert_close(reference[name], expected)
    plain = _trainer(model_dir, tmp_path, beta=0.1, loss_type="grpo")
    plain.train()
    assert all(torch.equal(p, start[n]) for n, p in plain.ref_model.named_parameters())


@pytest.mark.parametrize("target", [1e9, -1.0])
def test_adaptive_entropy_moves_the_coefficient_once_per_optimiser_step(model_dir, tmp_path, target):
    trainer = _trainer(model_dir, tmp_path, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=target,
                       entropy_coef_delta=0.004, max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    if target > 0:  # every step's entropy is below the target: up by delta per step, and the bonus acts
        assert trainer.entropy_coef == pytest.approx(0.01 + 2 * 0.004)
        assert trainer._comp.loss_fn.entropy_coef == pytest.approx(trainer.entropy_coef)
    else:  # always above: down to entropy_coef_min, and the gate keeps the bonus off
        assert trainer.entropy_coef == pytest.approx(0.002)
        assert trainer._comp.loss_fn.entropy_coef == 0.0
    assert trainer.state.log_history[-2]["entropy_coef"] == pytest.approx(trainer.entropy_coef)


def test_a_static_entropy_bonus_logs_its_coefficient(model_dir, tmp_path):
    trainer = _trainer(model_dir, tmp_path, entropy_coef=0.1)
    trainer.train()
    row = trainer.state.log_history[-2]  # the step's row (the last is the closing one)
    assert row["entropy_coef"] == 0.1 and "policy_loss" in row


def test_peft_configs_cohorts_kernel_would_silently_ignore_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="lm_head"):  # a LoRA on lm_head: the kernel reads lm_head.weight
        GRPOTrainer(
            model=str(model_dir), reward_funcs=distinct_chars, args=_args(tmp_path), train_dataset=toy_rows(1),
            peft_config=LoraConfig(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="prompt-learning"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, args=_args(tmp_path), train_dataset=toy_rows(1),
                    peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, args=_args(tmp_path),
                          train_dataset=toy_rows(1), peft_config=LoraConfig(target_modules=["q_proj"],
                                                                            modules_to_save=["lm_head"]))
    assert trainer.model.get_output_embeddings() is not None


def test_bad_data_and_num_generations_fail_before_any_weights_load(model_dir, tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(GRPOTrainer, "_load_models", lambda self, model: loaded.append(model))
    with pytest.raises(ValueError, match="train_dataset has no rows"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, args=_args(tmp_path), train_dataset=[])
    with pytest.raises(ValueError, match="train_dataset has no 'prompt' column"):
        GRPOTrainer(model=str(model_dir), reward_funcs=distinct_chars, args=_args(tmp_path),
                    train_dataset=[{"question": "Say 7"}] * 4)
    with pytest.raises(ValueError, match="GRPO requires at least 2 generations per prompt"):  # TRL's wording
        _args(tmp_path, num_generations=1)
    assert not loaded

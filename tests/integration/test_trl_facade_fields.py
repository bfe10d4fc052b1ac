"""Every field of TRL 1.16's GRPOConfig is mapped, announced or rejected, as fields.TABLE (and the docs) say."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import pytest

import cohort
from cohort import GRPOConfig
from cohort.errors import ConfigError
from cohort.trl_compat.fields import EXTRA_FIELDS, TABLE, kind, markdown_table

trl = pytest.importorskip("trl", reason="needs TRL: pip install trl==1.16.0")
TRL_FIELDS = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
ROOT = Path(__file__).resolve().parents[2]


def _trl_default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _status(name: str) -> str:
    return TABLE[name][1]


def _other(name: str, default):
    """A value unlike TRL's default, of a plausible type."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 2
    if isinstance(default, str):
        return default + "_x"
    if isinstance(default, list):
        return ["loss"]
    return {"x": 1} if "kwargs" in name or "config" in name else "x"


def test_every_trl_field_has_a_status_and_trls_default():
    assert set(TRL_FIELDS) == set(TABLE) - {name for name, _, _ in EXTRA_FIELDS}
    ours = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for name, f in TRL_FIELDS.items():
        assert kind(_status(name)) in ("mapped", "derived", "trainer", "announce", "reject"), name
        assert TABLE[name][0] == _trl_default(f), name
        default = ours[name].default if ours[name].default is not dataclasses.MISSING else ours[name].default_factory()
        assert default == _trl_default(f), name


# TRL 1.16's GRPOConfig defaults of the mapped fields, as cohort must hold them: (cohort key, value), literal
TRL_DEFAULTS_IN_COHORT = {
    "learning_rate": ("train.learning_rate", 1e-6), "weight_decay": ("train.weight_decay", 0.0),
    "adam_beta1": ("train.adam_beta1", 0.9), "adam_beta2": ("train.adam_beta2", 0.999),
    "adam_epsilon": ("train.adam_epsilon", 1e-8), "max_grad_norm": ("train.max_grad_norm", 1.0),
    "gradient_checkpointing": ("model.gradient_checkpointing", True), "torch_compile": ("model.compile_layers", False),
    "save_only_model": ("run.save_only_model", False), "save_total_limit": ("run.save_total_limit", None),
    "seed": ("train.seed", 42), "ddp_timeout": ("train.dist_timeout_s", 1800.0),
    "trust_remote_code": ("model.trust_remote_code", False), "num_generations": ("generation.num_generations", 8),
    "max_completion_length": ("generation.max_completion_length", 512), "shuffle_dataset": ("data.shuffle", True),
    "temperature": ("generation.temperature", 1.0), "top_p": ("generation.top_p", 1.0),
    "top_k": ("generation.top_k", 0), "repetition_penalty": ("generation.repetition_penalty", 1.0),
    "vllm_enable_sleep_mode": ("generation.release_kv_during_update", False),
    "vllm_server_timeout": ("generation.server_connect_timeout_s", 240.0),
    "vllm_max_model_length": ("generation.max_model_len", None), "beta": ("loss.beta", 0.0),
    "num_iterations": ("train.num_iterations", 1), "epsilon": ("loss.epsilon", 0.2), "delta": ("loss.delta", None),
    "epsilon_high": ("loss.epsilon_high", None), "importance_sampling_level": ("loss.importance_sampling_level", "token"),
    "reward_weights": ("reward.reward_weights", None),
    "multi_objective_aggregation": ("advantage.multi_objective_aggregation", "sum_then_normalize"),
    "loss_type": ("loss.loss_type", "dapo"), "mask_truncated_completions": ("generation.mask_truncated_completions", False),
    "top_entropy_quantile": ("loss.top_entropy_quantile", 1.0), "entropy_coef": ("loss.entropy_coef", 0.0),
    "max_tool_calling_iterations": ("generation.max_tool_calling_iterations", None),
    "vllm_importance_sampling_correction": ("loss.sampler_is_correction", True),
    "vllm_importance_sampling_clip_max": ("loss.sampler_is_clip_max", 3.0),
    "vllm_importance_sampling_clip_min": ("loss.sampler_is_clip_min", None),
    "off_policy_mask_threshold": ("loss.off_policy_mask_threshold", None),
    "use_bias_correction_kl": ("loss.use_bias_correction_kl", True), "log_completions": ("run.log_completions", False),
}
# mapped parameters of other losses than the default dapo (only that loss reads them)
OTHER_LOSS_FIELDS = ("sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos",
                     "vespo_k_neg", "vespo_lambda_neg")


def test_every_mapped_default_reaches_cohort_as_trls():
    cfg = GRPOConfig(output_dir="out").to_cohort(num_rows=64)
    from cohort.algorithms import policy_loss_parameters

    dapo = policy_loss_parameters("dapo")
    mapped = {name for name, (_, status) in TABLE.items() if kind(status) == "mapped"}
    assert mapped == set(TRL_DEFAULTS_IN_COHORT) | set(OTHER_LOSS_FIELDS)
    for name, (status, expected) in TRL_DEFAULTS_IN_COHORT.items():
        assert TABLE[name][1] == status, name
        section, key = status.split(".", 1)
        if section == "loss" and key != "loss_type":
            got = cfg.loss.loss_params().get(key, dapo[key])  # (unset: the loss's own default)
        else:
            got = getattr(getattr(cfg, section), key)
        assert got == expected, (name, got, expected)
    # the derived ones with TRL's meaning
    assert cfg.train.lr_scheduler_type == "linear" and cfg.train.adam_beta2 == 0.999
    assert cfg.generation.max_completion_length == 512 and cfg.model.gradient_checkpointing is True
    assert cfg.run.save_total_limit is None and cfg.train.learning_rate == 1e-6
    assert cfg.advantage.scale_rewards == "group" and cfg.generation.min_p == 0.0
    assert cfg.run.output_dir == "out" and cfg.model.dtype == "auto"
    assert GRPOConfig().to_cohort(num_rows=64).run.output_dir == "trainer_output"
    cfg.validate()


@pytest.mark.parametrize("name", sorted(n for n, (_, s) in TABLE.items() if kind(s) == "reject"))
def test_a_rejected_field_raises_naming_it(name):
    with pytest.raises(ConfigError, match=name):
        GRPOConfig(**{name: _other(name, TABLE[name][0])})


@pytest.mark.parametrize("name", sorted(n for n, (_, s) in TABLE.items() if kind(s) == "announce"))
def test_an_announced_field_logs_one_line(name, caplog):
    with caplog.at_level(logging.INFO, logger="cohort.trl_compat"):
        GRPOConfig(**{name: _other(name, TABLE[name][0])})
    lines = [r for r in caplog.records if r.name == "cohort.trl_compat"]
    assert len(lines) == 1 and name in lines[0].getMessage(), [r.getMessage() for r in lines]


def test_defaults_log_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="cohort.trl_compat"):
        GRPOConfig()
    assert not [r for r in caplog.records if r.name == "cohort.trl_compat"]


# a value unlike TRL's default for each mapped (non-loss) field -> (cohort key, the value cohort must hold)
MAPPED_VALUES = {
    "learning_rate": (2.000001, "train.learning_rate", 2.000001), "weight_decay": (2.0, "train.weight_decay", 2.0),
    "adam_beta1": (2.9, "train.adam_beta1", 2.9), "adam_beta2": (2.999, "train.adam_beta2", 2.999),
    "adam_epsilon": (2.00000001, "train.adam_epsilon", 2.00000001),
    "max_grad_norm": (3.0, "train.max_grad_norm", 3.0),
    "gradient_checkpointing": (False, "model.gradient_checkpointing", False),
    "torch_compile": (True, "model.compile_layers", True), "save_only_model": (True, "run.save_only_model", True),
    "save_total_limit": (3, "run.save_total_limit", 3), "seed": (44, "train.seed", 44),
    "ddp_timeout": (1802, "train.dist_timeout_s", 1802.0), "trust_remote_code": (True, "model.trust_remote_code", True),
    "num_generations": (4, "generation.num_generations", 4),
    "max_completion_length": (514, "generation.max_completion_length", 514),
    "shuffle_dataset": (False, "data.shuffle", False), "temperature": (3.0, "generation.temperature", 3.0),
    "top_p": (3.0, "generation.top_p", 3.0), "top_k": (2, "generation.top_k", 2),
    "repetition_penalty": (3.0, "generation.repetition_penalty", 3.0),
    "vllm_enable_sleep_mode": (True, "generation.release_kv_during_update", True),
    "vllm_server_timeout": (242.0, "generation.server_connect_timeout_s", 242.0),
    "vllm_max_model_length": (1024, "generation.max_model_len", 1024),
    "num_iterations": (3, "train.num_iterations", 3), "reward_weights": ([1.0], "reward.reward_weights", [1.0]),
    "multi_objective_aggregation": ("normalize_then_sum", "advantage.multi_objective_aggregation",
                                    "normalize_then_sum"),
    "mask_truncated_completions": (True, "generation.mask_truncated_completions", True),
    "max_tool_calling_iterations": (2, "generation.max_tool_calling_iterations", 2),
    "log_completions": (True, "run.log_completions", True),
}


def test_a_mapped_field_sets_its_cohort_key():
    mapped = {name for name, (_, status) in TABLE.items() if kind(status) == "mapped" and not status.startswith("loss.")}
    assert mapped == set(MAPPED_VALUES)
    for name, (value, status, expected) in MAPPED_VALUES.items():
        assert TABLE[name][1] == status, name
        cfg = GRPOConfig(**{name: value}).to_cohort(num_rows=64)
        section, key = status.split(".", 1)
        assert getattr(getattr(cfg, section), key) == expected, name


def test_loss_fields_reach_the_loss_that_reads_them():
    cfg = GRPOConfig(loss_type="sapo", sapo_temperature_neg=1.2, epsilon=0.3).to_cohort(num_rows=64)
    assert cfg.loss.loss_params()["sapo_temperature_neg"] == 1.2
    assert "epsilon" not in cfg.loss.loss_params()  # sapo has no epsilon, as TRL's sapo ignores it
    cfg = GRPOConfig(loss_type="cispo").to_cohort(num_rows=64)
    assert cfg.loss.loss_params()["epsilon_high"] == 0.2  # TRL: epsilon_high None means epsilon
    cfg = GRPOConfig(off_policy_mask_threshold=0.5, entropy_coef=0.01, vllm_importance_sampling_mode="token_mask",
                     vllm_importance_sampling_clip_max=2.0).to_cohort(num_rows=64)
    assert {k: cfg.loss.loss_params()[k] for k in ("off_policy_mask_threshold", "entropy_coef", "sampler_is_mode",
                                                   "sampler_is_clip_max")} == {
        "off_policy_mask_threshold": 0.5, "entropy_coef": 0.01, "sampler_is_mode": "token_mask",
        "sampler_is_clip_max": 2.0}


def test_scale_rewards_takes_trls_booleans_and_names():
    # TRL accepts True/False (older releases) as well as "group" / "batch" / "none"; False means no scaling
    for value, expected in ((False, "none"), (True, "group"), ("none", "none"), ("group", "group"),
                            ("batch", "batch")):
        assert GRPOConfig(scale_rewards=value).to_cohort(num_rows=64).advantage.scale_rewards == expected, value


def test_step_counts_follow_trl():
    # TRL: generation batch 8 x 4 = 32 completions = 8 prompts; 2 optimiser steps per generation
    args = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                      num_generations=4, max_steps=12, logging_steps=4, save_steps=6)
    cfg = args.to_cohort()
    assert (cfg.train.prompts_per_step, cfg.train.mini_batches, cfg.train.max_steps) == (8, 2, 6)
    assert (cfg.run.logging_steps, cfg.run.save_steps) == (2, 3)
    # epochs: 50 prompts, 8 per generation -> 6 whole generations an epoch, x spg 4 / ga 2 = 12 steps, x 3 epochs
    args = GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                      num_generations=4)
    assert args.optimizer_steps(num_rows=50) == 36
    assert args.to_cohort(num_rows=50).train.max_steps == 18
    assert GRPOConfig(num_train_epochs=0.5).optimizer_steps(num_rows=10) == 5  # 1 prompt per generation
    with pytest.raises(ConfigError, match="max_steps"):
        GRPOConfig().to_cohort(num_rows=None)
    with pytest.raises(ConfigError, match="num_generations"):
        GRPOConfig(per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(ConfigError, match="can not be both"):
        GRPOConfig(generation_batch_size=16, steps_per_generation=2)


def test_warmup_ratio_and_scheduler_names():
    args = GRPOConfig(max_steps=40, warmup_steps=0.1, lr_scheduler_type="cosine_with_min_lr",
                      lr_scheduler_kwargs={"min_lr_rate": 0.1})
    cfg = args.to_cohort()
    assert cfg.train.warmup_steps == 4 and cfg.train.lr_scheduler_type == "cosine_with_min_lr"
    assert GRPOConfig(max_steps=40, warmup_ratio=0.25).to_cohort().train.warmup_steps == 10
    assert GRPOConfig(lr_scheduler_type="cosine", max_steps=4).to_cohort().train.lr_scheduler_type == "hf:cosine"
    cfg.validate()


@pytest.mark.parametrize("kind_", ["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_min_lr",
                                   "polynomial", "inverse_sqrt", "warmup_stable_decay"])
def test_schedulers_are_transformers_own(kind_):
    import torch
    from transformers import get_scheduler

    from cohort.policy.optim import build_scheduler

    kwargs = {"cosine_with_min_lr": {"min_lr_rate": 0.1}, "warmup_stable_decay": {"num_decay_steps": 3}}.get(kind_, {})
    lrs = []
    for build in (lambda o: build_scheduler(o, kind=kind_ if kind_ not in ("cosine", "constant") else f"hf:{kind_}",
                                            warmup_steps=2, total_steps=10, kwargs=kwargs),
                  lambda o: get_scheduler(kind_, o, num_warmup_steps=2, num_training_steps=10,
                                          scheduler_specific_kwargs=kwargs)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, seen = build(opt), []
        for _ in range(10):
            seen.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        lrs.append(seen)
    assert all(math.isclose(a, b) for a, b in zip(*lrs)), lrs


def test_yaml_path_accepts_transformers_scheduler_names():
    cfg = cohort.load_config(None, ["train.lr_scheduler_type=cosine_with_min_lr",
                                    "train.lr_scheduler_kwargs.min_lr_rate=0.1", "train.warmup_steps=0.1"])
    assert cfg.train.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        cohort.load_config(None, ["train.lr_scheduler_type=cosinus"])


def test_unknown_generation_and_model_init_kwargs_are_rejected_by_name(caplog):
    with caplog.at_level(logging.WARNING, logger="cohort.trl_compat"):
        beams = GRPOConfig(generation_kwargs={"do_sample": True, "num_beams": 2, "length_penalty": -0.1,
                                              "top_k": 50}).to_cohort(num_rows=8)
    # options cohort's engine lacks: transformers' generate samples (as in TRL without vLLM), said once
    assert beams.generation.engine == "hf" and beams.generation.top_k == 50
    assert beams.generation.hf_generate_kwargs == {"num_beams": 2, "length_penalty": -0.1}
    assert any("transformers' generate samples" in r.getMessage() and "num_beams" in r.getMessage()
               for r in caplog.records)
    assert GRPOConfig(generation_kwargs={"top_k": 5}).to_cohort(num_rows=8).generation.engine == "auto"
    with pytest.raises(ConfigError, match=r"'num_beam'.*did you mean 'num_beams'"):
        GRPOConfig(generation_kwargs={"num_beam": 2}).to_cohort(num_rows=8).validate()
    greedy = GRPOConfig(generation_kwargs={"do_sample": False, "num_beams": 1}).to_cohort(num_rows=8)
    assert greedy.generation.temperature == 0.0  # transformers' do_sample=False: greedy decoding
    assert GRPOConfig(generation_kwargs={"do_sample": True}).to_cohort(num_rows=8).generation.temperature == 1.0
    cfg = GRPOConfig(generation_kwargs={"stop_strings": "</answer>", "max_new_tokens": 64}).to_cohort(num_rows=8)
    assert cfg.generation.stop_strings == ["</answer>"] and cfg.generation.max_completion_length == 64
    with pytest.raises(ConfigError, match="optim"):
        GRPOConfig(optim="sgd").to_cohort(num_rows=8)
    with pytest.raises(ConfigError, match="eval_strategy"):
        GRPOConfig(eval_strategy="epoch").to_cohort(num_rows=8)


def test_docs_table_is_generated_from_the_code():
    doc = (ROOT / "docs" / "trl_compat.md").read_text()
    assert markdown_table() in doc, "regenerate: python -m cohort.trl_compat.fields (see docs/trl_compat.md)"


def test_trl_command_line_parsers_build_cohorts_config():
    """TRL scripts parse GRPOConfig from the command line (TrlParser / HfArgumentParser): same flags, same types."""
    argv = ["--output_dir", "out", "--learning_rate", "2e-5", "--max_steps", "3", "--bf16", "false",
            "--report_to", "none", "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}', "--reward_weights", "1.0", "2.0",
            "--scale_rewards", "batch", "--warmup_steps", "0.1", "--lr_scheduler_type", "cosine_with_min_lr"]
    (args,) = trl.TrlParser((GRPOConfig,)).parse_args_and_config(args=argv)
    assert isinstance(args, GRPOConfig) and args.learning_rate == 2e-5 and args.bf16 is False
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and args.reward_weights == [1.0, 2.0]
    cfg = args.to_cohort(num_rows=10)
    assert cfg.train.warmup_steps == 1 and cfg.advantage.scale_rewards == "batch" and cfg.model.dtype == "float32"
    assert cfg.reward.reward_weights == [1.0, 2.0] and cfg.train.lr_scheduler_type == "cosine_with_min_lr"


def test_logging_strategy_no():
    cfg = GRPOConfig(logging_strategy="no", report_to="tensorboard").to_cohort(num_rows=8)
    assert cfg.run.logging_steps == 0 and cfg.run.report_to == ["console"]


# ------------------------------------------------------------------------- a trl.GRPOConfig object as args
# (a TRL script's GRPOConfig arguments, what cohort's config must hold for them with 64 prompts), literal
_SCRIPTS = [
    (dict(output_dir="out", use_cpu=True, bf16=False),
     # TRL defaults: 8 completions per generation = 1 prompt of 8; 64 prompts x 3 epochs = 192 steps
     {"train.prompts_per_step": 1, "train.mini_batches": 1, "train.max_steps": 192, "run.logging_steps": 10,
      "run.save_steps": 500, "run.save_at_end": True, "train.lr_scheduler_type": "linear", "train.warmup_steps": 0,
      "train.learning_rate": 1e-6, "loss.loss_type": "dapo", "advantage.scale_rewards": "group",
      "model.gradient_checkpointing": True, "generation.max_completion_length": 512, "generation.stop_strings": [],
      "model.dtype": "float32", "train.device": "cpu", "generation.num_generations": 8, "run.output_dir": "out"},
     None),
    (dict(output_dir="out", use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
          steps_per_generation=4, gradient_accumulation_steps=2, max_steps=10, logging_steps=2, save_strategy="no",
          lr_scheduler_type="cosine", warmup_steps=0.1, report_to="none", learning_rate=3e-6, beta=0.04,
          loss_type="grpo", scale_rewards="batch", gradient_checkpointing=False, max_completion_length=64,
          generation_kwargs={"stop_strings": ["</answer>"]}, chat_template_kwargs={"enable_thinking": False}),
     # 4 x 4 = 16 completions = 4 prompts of 4; 4 / 2 = 2 updates per generation; 10 / 2 = 5 steps
     {"train.prompts_per_step": 4, "train.mini_batches": 2, "train.max_steps": 5, "run.logging_steps": 1,
      "run.save_steps": 0, "run.save_at_end": False, "train.lr_scheduler_type": "hf:cosine", "train.warmup_steps": 1,
      "train.learning_rate": 3e-6, "loss.loss_type": "grpo", "advantage.scale_rewards": "batch",
      "model.gradient_checkpointing": False, "generation.max_completion_length": 64,
      "generation.stop_strings": ["</answer>"], "model.dtype": "float32", "train.device": "cpu",
      "generation.num_generations": 4, "run.output_dir": "out"},
     {"enable_thinking": False}),
]


def _values(cfg, keys) -> dict:
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys}


@pytest.mark.parametrize(("kwargs", "expected", "template_kwargs"), _SCRIPTS, ids=["defaults", "script"])
def test_a_trl_config_object_maps_as_cohorts_own(kwargs, expected, template_kwargs, caplog):
    theirs = trl.GRPOConfig(**kwargs)
    with caplog.at_level(logging.WARNING, logger="cohort.trl_compat"):
        converted = GRPOConfig.from_trl(theirs)
    assert not caplog.records, caplog.text  # TRL's resolved defaults are defaults, nothing to announce
    ours = GRPOConfig(**kwargs)
    assert _values(converted.to_cohort(num_rows=64), expected) == expected
    assert _values(ours.to_cohort(num_rows=64), expected) == expected
    assert converted.to_cohort(num_rows=64).loss.loss_params() == ({"beta": 0.04} if kwargs.get("beta") else {})
    assert converted.chat_template_kwargs == ours.chat_template_kwargs == template_kwargs


def test_a_trl_config_object_keeps_trls_resolved_bf16_and_its_checks():
    # TRL resolves bf16=None to True (bfloat16 even with use_cpu): the converted config means the same
    assert GRPOConfig.from_trl(trl.GRPOConfig(output_dir="out", use_cpu=True)).to_cohort(64).model.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="label_smoothing_factor"):
        GRPOConfig.from_trl(trl.GRPOConfig(output_dir="out", use_cpu=True, label_smoothing_factor=0.1))


def test_a_trl_config_object_is_accepted_by_the_trainer(tmp_path):
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import digit_share, tiny_model, toy_rows

    tok = make_tiny_tokenizer()
    args = trl.GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=6, max_steps=1, report_to="none",
                          gradient_checkpointing=False)
    trainer = cohort.GRPOTrainer(model=tiny_model(tok), processing_class=tok, reward_funcs=digit_share, args=args,
                                 train_dataset=toy_rows())
    assert isinstance(trainer.args, GRPOConfig) and trainer.config.train.prompts_per_step == 2
    assert len(trainer.train().history) == 1
    with pytest.raises(ConfigError, match="takes a GRPOConfig"):
        cohort.GRPOTrainer(model=tiny_model(tok), processing_class=tok, reward_funcs=digit_share,
                           args=object(), train_dataset=toy_rows())

"""A TRL-shaped front door: switch from TRL by changing one import.

    from cohort import GRPOConfig, GRPOTrainer          # was: from trl import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="smollm2-135m-instruct", reward_funcs=my_reward,
                          train_dataset=rows, args=GRPOConfig(output_dir="runs/x", num_generations=8))
    trainer.train()

`GRPOConfig` takes TRL's flat argument names and maps them onto cohort's sections; the trainer then runs
the very same loop as `cohort train`. TRL's batch arithmetic is kept: `generation_batch_size` completions
(= per_device_train_batch_size x steps_per_generation) are sampled per generation, i.e.
generation_batch_size / num_generations prompts; each optimiser step sees per_device_train_batch_size x
gradient_accumulation_steps completions. `max_steps` counts optimiser steps, as in TRL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from cohort.config import CohortConfig
from cohort.errors import ConfigError


@dataclass
class GRPOConfig:
    output_dir: str = "runs/grpo"
    learning_rate: float = 1e-6
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    steps_per_generation: int | None = None
    generation_batch_size: int | None = None
    num_generations: int = 8
    max_prompt_length: int = 512
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str | bool = "group"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    importance_sampling_level: str = "token"
    reward_weights: list[float] | None = None
    multi_objective_aggregation: str = "sum_then_normalize"
    top_entropy_quantile: float = 1.0
    max_steps: int = 100
    seed: int = 42
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "constant"
    warmup_steps: int = 0
    logging_steps: int = 1
    save_steps: int = 0
    save_total_limit: int | None = 2
    report_to: list[str] | str = field(default_factory=lambda: ["console", "jsonl"])
    log_completions: bool = False
    gradient_checkpointing: bool = False
    bf16: bool | None = None
    use_vllm: bool = False  # accepted for compatibility: cohort's own engine replaces vLLM
    extra: dict[str, Any] = field(default_factory=dict)  # any cohort dotted key, e.g. {"train.token_budget": 8192}

    def to_cohort(self) -> CohortConfig:
        cfg = CohortConfig()
        spg = self.steps_per_generation or self.gradient_accumulation_steps
        gen_batch = self.generation_batch_size or self.per_device_train_batch_size * spg
        if gen_batch % self.num_generations:
            raise ConfigError(f"generation_batch_size={gen_batch} must be a multiple of num_generations="
                              f"{self.num_generations}; change per_device_train_batch_size or steps_per_generation.")
        if spg % self.gradient_accumulation_steps:
            raise ConfigError(f"steps_per_generation={spg} must be a multiple of gradient_accumulation_steps="
                              f"{self.gradient_accumulation_steps}.")
        g, t, loss = cfg.generation, cfg.train, cfg.loss
        g.num_generations, g.max_completion_length = self.num_generations, self.max_completion_length
        g.temperature, g.top_p, g.top_k = self.temperature, self.top_p, self.top_k or 0
        g.min_p, g.repetition_penalty = self.min_p or 0.0, self.repetition_penalty
        g.mask_truncated_completions = self.mask_truncated_completions
        t.prompts_per_step = gen_batch // self.num_generations
        t.mini_batches = spg // self.gradient_accumulation_steps
        t.num_iterations = self.num_iterations
        t.max_steps = max(1, math.ceil(self.max_steps / (t.mini_batches * t.num_iterations)))
        for name in ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm",
                     "lr_scheduler_type", "warmup_steps", "seed"):
            setattr(t, name, getattr(self, name))
        loss.loss_type = self.loss_type
        candidates = {"beta": self.beta, "epsilon": self.epsilon, "epsilon_high": self.epsilon_high,
                      "delta": self.delta, "importance_sampling_level": self.importance_sampling_level,
                      "top_entropy_quantile": self.top_entropy_quantile if self.top_entropy_quantile < 1 else None}
        owned = _loss_parameter_names(self.loss_type)
        for name, value in candidates.items():  # TRL passes every knob; a cohort loss owns only its own
            if value is not None and (owned is None or name in owned):
                setattr(loss, name, value) if hasattr(loss, name) else loss.params.__setitem__(name, value)
        scale = self.scale_rewards
        cfg.advantage.scale_rewards = {True: "group", False: "none"}.get(scale, scale)  # type: ignore[arg-type]
        cfg.advantage.multi_objective_aggregation = self.multi_objective_aggregation
        cfg.reward.reward_weights = self.reward_weights
        cfg.data.max_prompt_length = self.max_prompt_length
        cfg.model.gradient_checkpointing = self.gradient_checkpointing
        if self.bf16 is False:
            cfg.model.dtype = "float32"
        r = cfg.run
        r.output_dir, r.logging_steps, r.save_steps = self.output_dir, self.logging_steps, self.save_steps
        r.save_total_limit, r.log_completions = self.save_total_limit, self.log_completions
        r.report_to = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        from cohort.config import apply_overrides

        apply_overrides(cfg, [f"{k}={v}" for k, v in self.extra.items()])
        return cfg


def _loss_parameter_names(loss_type: str) -> set[str] | None:
    from cohort.algorithms import policy_loss_parameters

    try:
        return set(policy_loss_parameters(loss_type))
    except Exception:  # a user loss given by import path: pass everything, it validates its own
        return None


class GRPOTrainer:
    """TRL's `GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class)`."""

    def __init__(self, model: Any, reward_funcs: Any, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 **unsupported: Any):
        if unsupported:
            raise ConfigError(f"GRPOTrainer got unsupported arguments {sorted(unsupported)}; cohort's facade "
                              "takes model, reward_funcs, args, train_dataset, eval_dataset, processing_class, peft_config.")
        if train_dataset is None:
            raise ConfigError("GRPOTrainer needs train_dataset= (rows with a 'prompt' column).")
        self.args = args or GRPOConfig()
        self.config = self.args.to_cohort()
        funcs = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        self.config.reward.funcs = list(funcs)
        if self.args.reward_weights is not None:
            self.config.reward.reward_weights = list(self.args.reward_weights)
        self.model, self.processing_class, self.peft_config = model, processing_class, peft_config
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.result = None

    def _components(self):
        from cohort.data import load_prompt_dataset
        from cohort.model import load_policy
        from cohort.setup import build_components, resolve_device, resolve_dtype

        cfg = self.config
        policy, tok = self.model, self.processing_class
        if isinstance(policy, str):
            device = resolve_device(cfg.train.device)
            policy, loaded_tok = load_policy(policy, dtype=resolve_dtype(cfg.model.dtype, device), device=device)
            tok = tok or loaded_tok
            cfg.model.name_or_path = self.model
        if tok is None:
            raise ConfigError("GRPOTrainer(model=<a model object>) also needs processing_class=<its tokenizer>.")
        if self.peft_config is not None:  # TRL's way to train LoRA adapters
            from peft import get_peft_model

            policy = get_peft_model(policy, self.peft_config)
        d = cfg.data

        def encode(rows):
            ds = load_prompt_dataset(rows, prompt_column=d.prompt_column, system_prompt=d.system_prompt)
            return ds.encode(tok, d.max_prompt_length, truncation=d.truncation)

        train = encode(self.train_dataset)
        evald = encode(self.eval_dataset) if self.eval_dataset is not None else None
        return build_components(cfg, policy=policy, tokenizer=tok, train_data=train, eval_data=evald)

    def train(self):
        from cohort.trainer import train

        self.result = train(self.config, self._components())
        return self.result


__all__ = ["GRPOConfig", "GRPOTrainer"]

"""`GRPOTrainer`: TRL 1.16's constructor and Trainer surface over cohort's one loop (`cohort.trainer.train`).

What it adds to the loop is only translation: TRL's arguments into one `CohortConfig`, datasets into prompt
rows, and the loop's hook events into transformers `TrainerCallback` calls with a TRL-like `state`/`control`.
This module is the trainer object and its TRL/Trainer methods; the pieces it delegates live beside it: `rows`
(datasets into prompt rows), `model_setup` (model_init_kwargs, dropout, tool schemas), `callbacks` (the
callback bridge and `state`) and `rewards` (reward functions and models).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from huggingface_hub import HfApi

from cohort import distributed
from cohort.checkpointing import latest_checkpoint
from cohort.checkpointing.interrupted import interrupted_message
from cohort.checkpointing.weights import unwrap_model
from cohort.data import check_text, load_prompt_dataset
from cohort.errors import ConfigError
from cohort.evaluation import evaluate
from cohort.policy.optim import build_scheduler
from cohort.run.directory import is_run_dir
from cohort.setup import build_components
from cohort.setup.rewards import build_environments, build_reward_runner
from cohort.trainer import train
from cohort.trl_compat.callbacks import CallbackBridge
from cohort.trl_compat.checks import (
    check_ref_sync,
    check_rows,
    check_sources,
    normalise_args,
    placeholder_rows,
    processing_class_list,
    warn_like_trl,
)
from cohort.trl_compat.config import GRPOConfig
from cohort.trl_compat.eval_loss import eval_loss
from cohort.trl_compat.fields import TABLE
from cohort.trl_compat.model_setup import apply_model_init_kwargs, load_trainer_models, tool_schemas
from cohort.trl_compat.rewards import TrlRewardRunner, resolve_reward_funcs
from cohort.trl_compat.rows import GivenRows, first_split, is_row, prompt_rows
from cohort.trl_compat.surface import SyncRefModel, TrlSurface
from cohort.vision.setup import encode_dataset, split_processor

if TYPE_CHECKING:
    from cohort.setup import Components
    from cohort.trainer import TrainResult

log = logging.getLogger("cohort.trl_compat")

class GRPOTrainer(TrlSurface):
    """TRL's `GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, ...)`."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list | None = None, rollout_func: Any = None,
                 environment_factory: Any = None):
        if quantization_config is not None:
            raise ConfigError("GRPOTrainer(quantization_config=...) is not supported by cohort: pass it as TRL's "
                              "GRPOConfig(model_init_kwargs={'quantization_config': BitsAndBytesConfig(load_in_4bit=True, "
                              "...)}) with peft_config= (QLoRA), or train LoRA on a bf16 model.")
        if rollout_func is not None:
            raise ConfigError("GRPOTrainer(rollout_func=...) is not supported by cohort: its own engine generates; "
                              "multi-turn rollouts go through tools= / environment_factory= (cohort.agents).")
        self.args = args = _as_config(args, model)
        self.reward_funcs = [] if reward_funcs is None else (
            list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs])
        # TRL's checks and changes to args, with its wording, before anything loads
        check_sources(args, train_dataset, self.reward_funcs, reward_processing_classes, environment_factory)
        check_ref_sync(args, peft_config if peft_config is not None else getattr(model, "peft_config", None))
        normalise_args(args, train_dataset, eval_dataset)
        warn_like_trl(args)
        self.model, self.processing_class, self.peft_config = model, processing_class, peft_config
        self.reward_processing_classes = processing_class_list(reward_processing_classes, len(self.reward_funcs))
        self.tools, self.environment_factory = tools, environment_factory  # read by cohort.agents
        self._init_entropy_control()
        self.optimizer, self.lr_scheduler = optimizers
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._setup_config(train_dataset)
        _join_process_group(self.config)
        self.callback_handler = CallbackBridge(self, list(callbacks or []))
        self.state = self.callback_handler.state
        if args.sync_ref_model:  # TRL adds its SyncRefModelCallback the same way
            self.add_callback(SyncRefModel(self))
        self.result: TrainResult | None = None
        self._comp: Components | None = None
        if tools:  # functions (or "pkg.module:function" paths): multi-turn tool calling (cohort.agents)
            self.config.agent.tools = list(tools)
        environments = None
        if environment_factory is not None:  # a class, a factory, a path, or {name: one} routed by `environment`
            self.config.agent.environment_factory = environment_factory
            environments = build_environments(self.config)  # no reset (or a bad tool method) fails here
        _check_before_loading(self.config, self.args)  # learning_rate=inf fails here, before any weights load
        self._load_models(model)
        self._environment_set = environments
        if environments is not None:  # as TRL: the environments' tools and get_reward functions join the lists
            given = {getattr(f, "__name__", None) for f in tools or []}
            self.tools = list(tools or []) + [t.function for t in environments.all_tools if t.name not in given]
            self.reward_funcs = self.reward_funcs + environments.reward_functions()
        self.callback_handler.event("on_init_end")

    def _setup_config(self, train_dataset) -> None:
        """The prompt rows (an environment that owns the data gets TRL's placeholder rows; a stream, the prompts
        the run will draw) and the cohort config they and the arguments make."""
        rows = placeholder_rows(self.args) if train_dataset is None else prompt_rows(train_dataset, self.args,
                                                                                        "train_dataset")
        self._train_rows_streamed = rows is None
        self.config = self.args.to_cohort(num_rows=None if rows is None else len(rows))
        if rows is None:  # streaming: take the prompts the run will draw, as TRL's stream would
            needed = self.config.train.max_steps * self.config.train.prompts_per_step
            rows = [dict(r) for r in itertools.islice(iter(train_dataset), needed)]
        if self.environment_factory is not None:  # TRL: rows without a prompt start empty; reset() supplies it
            column = self.config.data.prompt_column
            rows = [r if column in r else {**r, column: [{"role": "user", "content": ""}]} for r in rows]
        check_rows(rows, self.config.data.prompt_column)  # an empty dataset or no prompt column: before loading
        check_text(rows, "train_dataset")  # a lone surrogate fails here, not in the tokenizer
        self._train_rows = rows
        self.config.data.source = GivenRows(rows)  # the rows given, not cohort's default source (reasoning-gym)
        self.config.reward.funcs = self.reward_funcs
        self.config.agent.malformed_tool_calls = "end"  # TRL: a call its parser cannot read is no call
        self._quantization = apply_model_init_kwargs(self.args.model_init_kwargs, self.config)

    def _load_models(self, model) -> None:
        """As TRL's constructor: the policy (`self.model`, the object training updates in place), its processing
        class, the reference model (beta != 0) and reward models given by name, loaded once every check passed."""
        cfg = self.config
        if self.args.tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(self.args.tf32)
        self.model, self.processing_class, self.ref_model = load_trainer_models(
            model, self.processing_class, cfg, peft_config=self.peft_config, dropout_off=self.args.disable_dropout,
            quantization=self._quantization)
        cfg.reward.funcs = resolve_reward_funcs(self.reward_funcs, self.reward_processing_classes, cfg,
                                                state=self.state)
        self.reward_funcs = [getattr(r, "model", r) if isinstance(f, str | os.PathLike) else f  # TRL: the models
                             for f, r in zip(self.reward_funcs, cfg.reward.funcs, strict=True)]
        self.reward_processing_classes = [c if c is not None else getattr(r, "tokenizer", None)  # TRL's list
                                          for c, r in zip(self.reward_processing_classes, cfg.reward.funcs)]

    # --------------------------------------------------------------------------------------- callbacks
    def add_callback(self, callback) -> None:
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    # ------------------------------------------------------------------------------------------- build
    def _components(self):
        cfg, policy, tok = self.config, self.model, self.processing_class
        self._tool_schemas = tool_schemas(cfg, tok)
        train = self._encode(self._train_rows, tok)
        evald = None
        if str(getattr(self.args.eval_strategy, "value", self.args.eval_strategy)) != "no" and self.eval_dataset:
            evald = self._encode(prompt_rows(first_split(self.eval_dataset), self.args, "eval_dataset"), tok)
        self.ref_model = None  # build_components makes the run's reference (FSDP-sharded, compiled with the policy)
        comp = build_components(cfg, policy=policy, tokenizer=tok, train_data=train, eval_data=evald,
                                reward_runner=TrlRewardRunner(build_reward_runner(cfg)),
                                environments=self._environment_set)
        if self.optimizer is not None:  # optimizers=(optimizer, scheduler), as in transformers' Trainer
            comp = dataclasses.replace(comp, optimizer=self.optimizer, scheduler=self.lr_scheduler or build_scheduler(
                self.optimizer, kind=cfg.train.lr_scheduler_type, warmup_steps=cfg.train.warmup_steps,
                total_steps=cfg.train.max_steps * cfg.train.mini_batches * cfg.train.num_iterations,
                kwargs=cfg.train.lr_scheduler_kwargs))
        self.optimizer, self.lr_scheduler = comp.optimizer, comp.scheduler
        self._apply_entropy_coef(comp.loss_fn)  # the first step's coefficient (adaptive: off until measured)
        self.model, self.ref_model = comp.policy, comp.reference
        return comp

    def _encode(self, rows, tok):
        d = self.config.data
        ds = load_prompt_dataset(list(rows), prompt_column=d.prompt_column, system_prompt=d.system_prompt)
        kwargs = dict(self.args.chat_template_kwargs or {})
        if getattr(self, "_tool_schemas", None):  # TRL: the prompts list the tools
            kwargs["tools"] = self._tool_schemas
        tokenizer, processor = split_processor(tok)
        policy = self.model if hasattr(self.model, "parameters") else None
        return encode_dataset(ds, tokenizer, processor, policy, d.max_prompt_length, d.truncation,
                              chat_template_kwargs=kwargs or None, model_name=self.config.model.name_or_path)

    # -------------------------------------------------------------------------------------------- API
    def train(self, resume_from_checkpoint: bool | str | None = None, **kwargs):
        """Train; resume_from_checkpoint=True continues from the newest checkpoint in output_dir, a path from
        that checkpoint folder (cohort's output_dir/checkpoints/step-N)."""
        if kwargs:
            raise ConfigError(f"GRPOTrainer.train() got unexpected arguments {sorted(kwargs)}.")
        cfg = self.config
        if resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is not True and not Path(path).is_dir():
                raise ConfigError(f"train(resume_from_checkpoint={path!r}): no such checkpoint folder.")
            if path is True and latest_checkpoint(cfg.run.output_dir) is None:  # TRL raises here too
                raise ConfigError(f"train(resume_from_checkpoint=True): no checkpoint in {cfg.run.output_dir}"
                                  "/checkpoints to resume from (save_strategy='no' writes none); call train() "
                                  "without it to start over, or pass a checkpoint folder.")
            cfg.run.resume = True if path is True else str(path)
        elif not cfg.run.resume:
            cfg.run.overwrite = True  # TRL writes into an existing output_dir
            if Path(cfg.run.output_dir).is_dir() and is_run_dir(Path(cfg.run.output_dir)):
                log.warning("output_dir %s holds an earlier cohort run: this train() replaces it (pass "
                            "resume_from_checkpoint=True to continue it instead).", cfg.run.output_dir)
        if self._comp is None:
            self._comp = self._components()
        if self.args.eval_on_start and self.eval_dataset:
            self.evaluate()
        started = time.monotonic()
        try:
            self.result = train(cfg, self._comp, callbacks=[self.callback_handler])
        except KeyboardInterrupt:  # Ctrl-C: the CLI's message, with the call that continues; then stop as Python does
            if distributed.current().is_main:
                print(interrupted_message(cfg.run.output_dir, resume="trainer.train(resume_from_checkpoint=True)",
                                          restart="trainer.train()", restart_over_progress="trainer.train()"),
                      file=sys.stderr)
            raise
        self.callback_handler.finish(time.monotonic() - started, steps_done=len(self.result.history))
        if self.args.push_to_hub:  # TRL pushes the final model when training ends
            self.push_to_hub()
        return self.result

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
                 ) -> dict[str, float]:
        """Generate on eval_dataset (a Dataset, rows, or a dict of them) and score: TRL's eval_loss (the GRPO
        objective on sampled groups, `eval_loss`), eval_reward, eval_accuracy (first reward function >= 1),
        eval_pass@k with num_generations_eval > 1. A dict of splits gives eval_<split>_* each. Logged like TRL's."""
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if data is None:
            raise ConfigError("evaluate() needs an eval_dataset (GRPOTrainer(eval_dataset=...) or evaluate(rows)).")
        if isinstance(data, dict) and not is_row(data):  # DatasetDict / dict of splits: one prefix each
            out: dict[str, float] = {}
            for name, split in data.items():
                out.update(self.evaluate(split, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        if self._comp is None:
            self._comp = self._components()
        comp = dataclasses.replace(self._comp, eval_data=self._encode(prompt_rows(data, self.args, "eval_dataset"),
                                                                      self.processing_class))
        metrics = {"loss": eval_loss(comp, self.config, comp.eval_data,  # TRL's first key
                                     self.args.num_generations_eval or self.args.num_generations),
                   **evaluate(comp, self.config)}
        out = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.callback_handler.log_eval(out)
        return out

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Weights (or the LoRA adapters), config and tokenizer in `output_dir` (default args.output_dir),
        loadable with from_pretrained."""
        if self.config.train.sharding != "fsdp" and not self.is_world_process_zero():
            return  # every rank holds the same weights: rank 0 writes them, as TRL's should_save
        out = Path(output_dir or self.config.run.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = self._comp.policy if self._comp is not None else self.model
        unwrap_model(model).save_pretrained(out)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs) -> str:
        """Save the model and upload it to args.hub_model_id. Offline (HF_HUB_OFFLINE=1) or when the upload
        fails, the model stays in output_dir/hub/<repo name> and a log line says so; no exception."""
        repo = self.args.hub_model_id or Path(self.config.run.output_dir).name
        local = Path(self.config.run.output_dir) / "hub" / repo.replace("/", "__")
        self.save_model(str(local))
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
            log.warning("push_to_hub: HF_HUB_OFFLINE is set, so nothing was uploaded; the model is in %s "
                        "(upload it later with `huggingface-cli upload %s %s`).", local, repo, local)
            return str(local)
        try:
            api = HfApi(token=token or self.args.hub_token)
            api.create_repo(repo, private=self.args.hub_private_repo, exist_ok=True)
            info = api.upload_folder(repo_id=repo, folder_path=str(local), commit_message=commit_message,
                                     revision=revision or self.args.hub_revision)
            return str(getattr(info, "commit_url", info))
        except Exception as exc:  # (network, auth: reported, never a traceback)
            log.warning("push_to_hub: upload to %r failed (%s: %s); the model is in %s.", repo,
                        type(exc).__name__, exc, local)
            return str(local)

    # ---------------------------------------------- what TRL's scripts call besides train (trl/scripts/grpo.py)
    @property
    def hub_model_id(self) -> str:
        return self.args.hub_model_id or Path(self.config.run.output_dir).name

    def is_world_process_zero(self) -> bool:
        return distributed.current().is_main

    is_local_process_zero = is_world_process_zero

    def end(self) -> None:
        """transformers >= 5.18's end(): cohort's loop closes its loggers itself; nothing is left open."""

    def save_state(self) -> None:
        self.state.save_to_json(str(Path(self.config.run.output_dir) / "trainer_state.json"))

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        print(f"***** {split} metrics *****\n" + "\n".join(f"  {k} = {v}" for k, v in sorted(metrics.items())))

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        path = Path(self.config.run.output_dir) / f"{split}_results.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(metrics, indent=4, sort_keys=True))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add a row to state.log_history and call the callbacks' on_log, as transformers' Trainer.log."""
        self.callback_handler.log(dict(logs))


def _join_process_group(cfg) -> None:
    """Under torchrun (WORLD_SIZE > 1), join the process group as TRL's Trainer does when it is made (gloo on
    CPUs, NCCL on GPUs); at exit every rank meets at a barrier before the group ends, so no rank tears
    communication down under a peer still saving or evaluating."""
    if distributed.world_size_from_env() > 1 and not distributed.current().enabled:
        distributed.init_from_env(timeout_s=cfg.train.dist_timeout_s)
        atexit.register(distributed.shutdown)


def _check_before_loading(cfg, args) -> None:
    """The converted config's checks (`CohortConfig.validate`: every range, enum and cross-field rule) in the
    constructor, as TRL checks its arguments there, so a bad value fails before the model loads. Reward models
    named by a path or hub id load weights when resolved (in train()); a stand-in takes their place here. An
    error names the GRPOConfig field as well as cohort's."""
    funcs = [f if callable(f) and not isinstance(f, str | os.PathLike) else _stand_in_reward for f in cfg.reward.funcs]
    probe = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, funcs=funcs))
    try:
        probe.validate()
    except ConfigError as exc:
        key = str(exc).split("=", 1)[0]
        names = [name for name, (_, status) in TABLE.items() if status == key]
        if not names:
            raise
        raise ConfigError(f"GRPOConfig({names[0]}={getattr(args, names[0], None)!r}): {exc}") from None


def _as_config(args, model):
    """cohort's GRPOConfig from args: None gives TRL's default ("<model name>-GRPO" in the working directory), a
    trl.GRPOConfig goes through the same field table."""
    if args is None:
        name = model if isinstance(model, str | os.PathLike) else getattr(model.config, "_name_or_path", "")
        return GRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-GRPO")
    if hasattr(args, "to_cohort"):
        return args
    if not _is_trl_config(args):
        raise ConfigError(f"GRPOTrainer(args=...) takes a GRPOConfig (cohort's, or TRL's trl.GRPOConfig); "
                          f"got {type(args).__module__}.{type(args).__name__}.")
    return GRPOConfig.from_trl(args)  # TRL's own config object: the same fields, the same mapping


def _stand_in_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _is_trl_config(args) -> bool:
    return type(args).__module__.split(".")[0] == "trl" and type(args).__name__ == "GRPOConfig"

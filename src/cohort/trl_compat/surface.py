"""The members of TRL's `GRPOTrainer` beyond the Trainer API that user code and TRL's own tests read, call or
patch: the loss helpers as TRL exposes them (`get_high_entropy_mask`, `get_off_policy_mask`, computed with
cohort's own `cohort.algorithms` functions), `reward_func_names`, `reward_weights`, `aux_loss_enabled`, the
`_logs` of the last logged completions, a settable `accelerator`, and `get_train_dataloader` /
`get_eval_dataloader` over the prompt rows.

`TrlSurface` is a mixin of `cohort.trl_compat.GRPOTrainer`; it reads `self.args`, `self.config`, `self.model`,
`self.reward_funcs` and the rows the trainer holds.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import TrainerCallback

from cohort import distributed
from cohort.algorithms.corrections import high_entropy_mask, off_policy_sequence_mask
from cohort.rewards.protocol import reward_name
from cohort.trl_compat.rows import first_split, prompt_rows


class Accelerator:
    """The `trainer.accelerator` members TRL's scripts and helpers use, for cohort's torchrun ranks."""

    def __init__(self):
        info = distributed.current()
        self.process_index, self.num_processes = info.rank, info.world_size
        self.is_main_process = self.is_local_main_process = info.is_main
        self.device = torch.device("cpu")

    def print(self, *args, **kwargs) -> None:
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        distributed.barrier()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (equal shapes) concatenated along dim 0, in rank order."""
        return distributed.all_gather_rows(tensor)

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: Any = 0) -> torch.Tensor:
        """`tensor` padded with `pad_index` along `dim` to the longest of any rank's."""
        longest = distributed.all_max(int(tensor.shape[dim]))
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest - tensor.shape[dim]
        return torch.cat([tensor, tensor.new_full(shape, pad_index)], dim=dim)


class SyncRefModel(TrainerCallback):
    """TRL's `sync_ref_model` (TR-DPO, arXiv:2404.09656), as TRL adds it: after every `ref_model_sync_steps`-th
    optimiser step the reference becomes `ref_model_mixup_alpha` x policy + (1 - alpha) x reference, in place
    (the reference cohort's update scores against)."""

    def __init__(self, trainer):
        self.trainer = trainer

    @torch.no_grad()
    def on_step_end(self, args, state, control, model=None, **kwargs):
        reference = self.trainer.ref_model
        if reference is None or model is None or state.global_step % args.ref_model_sync_steps:
            return
        alpha = float(args.ref_model_mixup_alpha)
        for ref, param in zip(reference.parameters(), model.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(param.detach().to(ref.dtype), alpha=alpha)


class TrlSurface:
    """TRL's GRPOTrainer attributes and helpers (see the module docstring)."""

    # set by the trainer: what these members read
    args: Any
    config: Any
    model: Any
    reward_funcs: list
    eval_dataset: Any
    _train_rows: list[dict]
    _train_rows_streamed: bool
    _accelerator: Accelerator | None = None
    _environment_set: Any = None  # cohort.agents.Environments of environment_factory (None without)

    # ------------------------------------------------------------------------------- environments
    @property
    def environments(self) -> list | None:
        """TRL's per-rollout environment instances of the last generation batch, in rollout order (None before
        the first batch or without environment_factory)."""
        env = self._environment_set
        sessions = getattr(env, "last_sessions", None)
        return [s.instance for s in sessions] if sessions else None

    @property
    def _env_tools(self) -> dict:
        """TRL's {environment name: the tools a rollout of it sees} (the probe instance's bound methods)."""
        env = self._environment_set
        return {} if env is None else {name: [t.function for t in tools] for name, tools in env._tools.items()}

    @property
    def _environment_pool(self) -> dict:
        """TRL's {environment name: the reusable instances} (the probe seeds each pool)."""
        return {} if self._environment_set is None else self._environment_set._pool

    @property
    def accelerator(self) -> Any:
        if self._accelerator is None:
            self._accelerator = Accelerator()
        return self._accelerator

    @accelerator.setter
    def accelerator(self, value: Any) -> None:  # tests and wrappers replace it, as they can on TRL's
        self._accelerator = value

    # ------------------------------------------------------------------------------ TRL's loss helpers
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """Bool mask of the tokens whose entropy is at or above the `threshold` quantile of every rank's
        unpadded entropies (TRL passes 1 - top_entropy_quantile); all False when no token is unpadded."""
        values = entropies[mask.bool()].float()
        acc = self.accelerator
        if getattr(acc, "num_processes", 1) > 1:  # the quantile over all ranks' tokens, padded to one length
            padded = acc.pad_across_processes(values, dim=0, pad_index=math.nan)
            gathered = acc.gather(padded)
            values = gathered[~torch.isnan(gathered)]
        if values.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        cut = torch.quantile(values, float(threshold))
        return high_entropy_mask(entropies, mask, cut).bool()

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """[B, 1] float: 0 for a sequence with a negative advantage whose mean token KL from the sampler
        (sampling - current logprob, padding ignored) exceeds the threshold (DeepSeek-V3.2's OPSM), else 1."""
        return off_policy_sequence_mask(advantages, per_token_logps, sampling_per_token_logps, mask.float(),
                                        off_policy_threshold)

    # --------------------------------------------------------------------------------- attributes
    @property
    def reward_func_names(self) -> list[str]:
        """TRL's names: a function's __name__, a reward model's checkpoint name (the last part of its path)."""
        names = []
        for func in self.reward_funcs:
            config = getattr(func, "config", None)
            if config is not None and isinstance(func, torch.nn.Module):
                names.append(str(getattr(config, "_name_or_path", "") or "reward_model").rstrip("/").split("/")[-1])
            else:
                names.append(reward_name(func))
        return names

    @property
    def reward_weights(self) -> torch.Tensor:
        weights = list(self.args.reward_weights or [])
        weights = weights or [1.0] * len(self.reward_funcs)
        # an environment's get_reward (appended to reward_funcs) weighs 1, as in TRL
        return torch.tensor(weights + [1.0] * (len(self.reward_funcs) - len(weights)), dtype=torch.float32)

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether the MoE router's load-balancing loss is on: the model has routers (its text config has
        output_router_logits) and router_aux_loss_coef is not 0, as TRL decides."""
        config = getattr(self.model, "config", None)
        if config is None:
            return False
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        coef = self.args.router_aux_loss_coef
        if coef is None:
            coef = getattr(text, "router_aux_loss_coef", 0.0) or 0.0
        return hasattr(text, "output_router_logits") and coef != 0.0

    @property
    def _logs(self) -> dict[str, Any]:
        """TRL's record of the latest logged completions, one generation batch of them (log_completions=True
        writes them to samples.jsonl): prompt, completion, rewards (the combined reward, under "reward"),
        advantages, extra (log_extra's columns), images (cohort logs none)."""
        size = max(1, self.args._batch()[0])  # TRL's deques hold generation_batch_size entries
        logs: dict[str, Any] = {"images": deque(maxlen=size), "prompt": deque(maxlen=size),
                                "completion": deque(maxlen=size), "rewards": {"reward": deque(maxlen=size)},
                                "advantages": deque(maxlen=size), "extra": {}}
        path = Path(self.config.run.output_dir) / "samples.jsonl"
        if not path.is_file():
            return logs
        known = {"step", "prompt", "completion", "reward", "advantage"}
        with path.open(encoding="utf-8") as f:
            for row in map(json.loads, filter(str.strip, f)):
                logs["prompt"].append(row.get("prompt"))
                logs["completion"].append(row.get("completion"))
                logs["advantages"].append(row.get("advantage"))
                logs["rewards"]["reward"].append(row.get("reward"))
                for key in row.keys() - known:
                    logs["extra"].setdefault(key, deque(maxlen=size)).append(row[key])
        return logs

    # ----------------------------------------------------------------------------------- entropy bonus
    def _init_entropy_control(self) -> None:
        """TRL's entropy-bonus state: the current coefficient (`entropy_coef`, public as in TRL), whether it
        adapts, and the last step's entropy the adaptive gate reads (inf before the first step: bonus off)."""
        self.entropy_coef = float(self.args.entropy_coef)
        self.use_adaptive_entropy = bool(self.args.use_adaptive_entropy)
        self._entropy_bonus_enabled = self.entropy_coef != 0.0 or self.use_adaptive_entropy
        self._last_world_entropy = math.inf

    def _apply_entropy_coef(self, loss_fn: Any) -> None:
        """The coefficient the next optimiser steps use: with use_adaptive_entropy, the bonus acts only while
        the last step's entropy is at or below entropy_target (TRL's gate)."""
        gated = self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target
        loss_fn.entropy_coef = 0.0 if gated else float(self.entropy_coef)

    def _after_step(self, metrics: dict[str, Any], updates: int) -> dict[str, Any]:
        """After each cohort step (one generation, `updates` optimiser steps): the adaptive controller moves the
        coefficient by entropy_coef_delta towards entropy_target once per optimiser step, within
        [entropy_coef_min, entropy_coef_max], from the step's mean token entropy; returns the entropy_coef TRL
        logs while the bonus is on."""
        if not self._entropy_bonus_enabled:
            return {}
        entropy = metrics.get("entropy")
        if self.use_adaptive_entropy and isinstance(entropy, int | float) and math.isfinite(entropy):
            a = self.args
            for _ in range(max(1, updates)):
                step = a.entropy_coef_delta if entropy <= a.entropy_target else -a.entropy_coef_delta
                self.entropy_coef = min(max(self.entropy_coef + step, a.entropy_coef_min), a.entropy_coef_max)
            self._last_world_entropy = float(entropy)
        comp = getattr(self, "_comp", None)
        if comp is not None:
            self._apply_entropy_coef(comp.loss_fn)
        return {"entropy_coef": self.entropy_coef}

    # --------------------------------------------------------------------------------- data loaders
    def get_train_dataloader(self) -> DataLoader:
        """The train prompt rows as a DataLoader (a streaming dataset loads with num_workers=0, as in TRL)."""
        return self._rows_loader(self._train_rows, streaming=self._train_rows_streamed)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if data is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        streaming = type(first_split(data)).__name__ == "IterableDataset"
        rows = prompt_rows(first_split(data), self.args, "eval_dataset") or []
        return self._rows_loader(rows, streaming=streaming, batch_size=self.args.per_device_eval_batch_size)

    def _rows_loader(self, rows: Any, *, streaming: bool, batch_size: int | None = None) -> DataLoader:
        workers = 0 if streaming else int(self.args.dataloader_num_workers)
        return DataLoader(rows, batch_size=batch_size or self.args.per_device_train_batch_size,
                          num_workers=workers, collate_fn=list)

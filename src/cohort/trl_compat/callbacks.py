"""transformers `TrainerCallback`s on cohort's loop: the loop's hook events become on_train_begin, on_step_end,
on_log, on_evaluate, on_save, on_train_end calls with transformers' own `TrainerState` / `TrainerControl`.

Steps are TRL's: `state.global_step` counts optimiser steps, so one cohort step (one generation) advances it
by steps_per_generation / gradient_accumulation_steps x num_iterations; the callbacks run once per cohort
step, after its optimiser steps. `state.log_history` holds TRL-shaped rows (metrics, "epoch", "step").
"""

from __future__ import annotations

import math
from typing import Any


def _transformers_state():
    from transformers import TrainerControl, TrainerState

    return TrainerState, TrainerControl


class CallbackBridge:
    def __init__(self, trainer, callbacks: list):
        TrainerState, TrainerControl = _transformers_state()
        self.trainer = trainer
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks]
        from cohort import distributed

        main = distributed.current().is_main
        self.state = TrainerState(is_local_process_zero=main, is_world_process_zero=main)
        self.control = TrainerControl()
        args, cfg = trainer.args, trainer.config
        self.per_gen = args.updates_per_generation()
        self.state.max_steps = cfg.train.max_steps * self.per_gen
        self.state.logging_steps = cfg.run.logging_steps * self.per_gen
        self.state.eval_steps = cfg.run.eval_steps * self.per_gen
        self.state.save_steps = cfg.run.save_steps * self.per_gen
        self.state.train_batch_size = args.per_device_train_batch_size
        self._losses: list[float] = []

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        for c in list(self.callbacks):
            if c is callback or (isinstance(callback, type) and isinstance(c, callback)):
                self.callbacks.remove(c)
                return c
        return None

    def event(self, name: str, **kwargs: Any) -> None:
        t = self.trainer
        for cb in self.callbacks:
            method = getattr(cb, name, None)
            if method is None:
                continue
            result = method(t.args, self.state, self.control, model=t.model, processing_class=t.processing_class,
                            optimizer=t.optimizer, lr_scheduler=t.lr_scheduler, **kwargs)
            if result is not None and hasattr(result, "should_training_stop"):
                self.control = result

    # --------------------------------------------------------------------------- the loop's hook
    def hook(self, event: str, step: int, payload: dict) -> bool:
        s, cfg = self.state, self.trainer.config
        s.global_step = step * self.per_gen
        rows = len(self.trainer._train_rows or []) or 1
        s.epoch = step * cfg.train.prompts_per_step / rows
        s.num_train_epochs = math.ceil(cfg.train.max_steps * cfg.train.prompts_per_step / rows)
        if event == "train_begin":
            self.event("on_train_begin")
            self.event("on_epoch_begin")
        elif event == "log":
            self.control.should_log = False
            self.event("on_step_end")
            if "loss" in payload:
                self._losses.append(float(payload["loss"]))
            last = step >= cfg.train.max_steps
            every = cfg.run.logging_steps
            if (every and (step % every == 0 or last)) or self.control.should_log:
                self.log({k: v for k, v in payload.items() if not k.startswith("eval/")})
            evals = {f"eval_{k[5:]}": v for k, v in payload.items() if k.startswith("eval/")}
            if evals:
                self.log_eval(evals)
            return bool(self.control.should_training_stop)
        elif event == "save":
            self.event("on_save", checkpoint=payload.get("path"))
        elif event == "evaluate":
            self.log_eval({f"eval_{k}": v for k, v in payload.items()})
        elif event == "train_end":
            self.event("on_epoch_end")
        return False

    def log(self, logs: dict[str, Any]) -> None:
        row = {**{k: _plain(v) for k, v in logs.items()}, "epoch": self.state.epoch, "step": self.state.global_step}
        self.state.log_history.append(row)
        self.event("on_log", logs=row)

    def log_eval(self, metrics: dict[str, float]) -> None:
        self.log(metrics)
        self.event("on_evaluate", metrics=metrics)

    def finish(self, runtime_s: float) -> None:
        """TRL's closing row (train_runtime, train_loss, ...) and on_train_end."""
        s, cfg = self.state, self.trainer.config
        completions = s.global_step / max(1, self.per_gen) * cfg.completions_per_step
        self.log({"train_runtime": runtime_s, "train_samples_per_second": completions / max(runtime_s, 1e-9),
                  "train_steps_per_second": s.global_step / max(runtime_s, 1e-9),
                  "train_loss": sum(self._losses) / len(self._losses) if self._losses else float("nan")})
        self.event("on_train_end")


def _plain(value: Any) -> Any:
    try:
        return float(value) if not isinstance(value, bool | int | str) else value
    except (TypeError, ValueError):
        return value

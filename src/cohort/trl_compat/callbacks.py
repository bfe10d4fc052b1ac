"""transformers `TrainerCallback`s on cohort's loop: the loop's typed callbacks (`cohort.run.callbacks`) become
the callback calls transformers' Trainer makes, in its order, with transformers' own `TrainerState` / `TrainerControl`.

Steps are TRL's: `state.global_step` counts optimiser steps. Each optimiser update of a cohort step (one
generation) gets on_step_begin, on_pre_optimizer_step, on_optimizer_step and on_step_end, as in TRL; the first
update's on_step_begin comes before the step generates (TRL generates inside its first training_step). The
step's metrics are logged once, after its last update (`state.log_history` holds TRL-shaped rows: metrics,
"epoch", "step"), then come the evaluation and the checkpoint (on_log, on_evaluate, on_save).

`control` flags are set as transformers' DefaultFlowCallback sets them before the user's on_step_end runs
(should_log / should_evaluate / should_save when due, should_training_stop at max_steps) and cleared where its
CallbackHandler clears them. A callback's `should_training_stop`, `should_log`, `should_evaluate` and
`should_save` are honoured at the end of the cohort step (the EVALUATE / SAVE / STOP decisions of `before_log`
and `on_log`). The state is saved in each checkpoint (`checkpoint_state`) and restored on resume, so a
resumed run's `log_history` and `global_step` equal an uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from transformers import TrainerControl, TrainerState

from cohort import distributed
from cohort.run.callbacks import Callback, Decision, UpdateEvent

# what a checkpoint keeps of transformers' TrainerState (the rest is recomputed from the step)
_SAVED_FIELDS = ("log_history", "total_flos", "num_input_tokens_seen", "best_metric", "best_global_step",
                 "best_model_checkpoint", "trial_name", "trial_params")


# metrics a logged row takes from its last step rather than averaging over the steps since the previous row:
# transformers logs the last update's grad_norm and learning_rate; the others are running totals
_LATEST = frozenset({"grad_norm", "learning_rate", "num_tokens", "train_time", "step"})


def _transformers_state():
    return TrainerState, TrainerControl


class CallbackBridge(Callback):
    def __init__(self, trainer, callbacks: list):
        TrainerState, TrainerControl = _transformers_state()
        self.trainer = trainer
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks]
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
        self._pending: list[dict[str, Any]] = []  # the steps' metrics since the last logged row
        self._update = 0  # optimiser updates done in the current cohort step
        self._deferred_save: dict | None = None  # the last step's on_save, called after its evaluation

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
    def _at(self, step: int, updates: int = 0) -> None:
        """global_step / epoch after `updates` optimiser updates of cohort step `step` (0: before it)."""
        s, cfg = self.state, self.trainer.config
        done = (step - 1) * self.per_gen + updates if updates else step * self.per_gen
        s.global_step = done
        rows = len(self.trainer._train_rows or []) or 1
        s.epoch = done / self.per_gen * cfg.train.prompts_per_step / rows
        s.num_train_epochs = math.ceil(cfg.train.max_steps * cfg.train.prompts_per_step / rows)

    def on_resume(self, step: int, saved: dict) -> None:
        self._restore(saved.get("trl_state") or {})

    def on_train_begin(self, step: int) -> None:
        self._at(step)
        self.control._new_training()
        self.event("on_train_begin")
        self.control._new_epoch()
        self.event("on_epoch_begin")

    def on_step_begin(self, step: int) -> None:
        self._at(step - 1)
        self._update = 0
        self._step_begin()

    def on_update(self, step: int, event: UpdateEvent) -> None:
        if event is UpdateEvent.BEGIN:
            self._update_begin()
        elif event is UpdateEvent.PRE_OPTIMIZER_STEP:
            self.event("on_pre_optimizer_step")
        elif event is UpdateEvent.OPTIMIZER_STEP:
            self.event("on_optimizer_step")
        else:
            self._update_end(step)

    def _update_begin(self) -> None:
        if self._update > 0:  # the first update's on_step_begin came before the step generated
            self._step_begin()

    def _update_end(self, step: int) -> None:
        self._update += 1
        self._at(step, self._update)
        self._flow(step, last_update=self._update == self.per_gen)
        self.event("on_step_end")

    def on_log(self, step: int, metrics: dict) -> Decision:
        """STOP when a callback (or max_steps) set should_training_stop; SAVE when should_save is set (by the
        flow when due, or by a callback), asked after the row is logged, as transformers does."""
        decision = Decision.STOP if self._log(step, metrics) else Decision.CONTINUE
        return decision | (Decision.SAVE if self.control.should_save else Decision.CONTINUE)

    def _log(self, step: int, payload: dict) -> bool:
        self._at(step)
        after_step = getattr(self.trainer, "_after_step", None)  # the trainer's per-step controllers (entropy)
        if after_step is not None:
            payload = {**payload, **after_step(payload, self.per_gen)}
        if "loss" in payload:
            self._losses.append(float(payload["loss"]))
        # the loop repeats its prompt statistics (data/*) on the first step after a resume; the history keeps
        # them at step 1 only, as an uninterrupted run has them
        self._pending.append({k: v for k, v in payload.items()
                              if not k.startswith("eval/") and (step == 1 or not k.startswith("data/"))})
        if self.control.should_log:
            self.log(self._window())
        evals = {f"eval_{k[5:]}": v for k, v in payload.items() if k.startswith("eval/")}
        if evals:
            self.log_eval(evals)
        return bool(self.control.should_training_stop)

    def before_log(self, step: int) -> Decision:
        # should_evaluate: set by the flow when due, or by a callback's on_step_end
        return Decision.EVALUATE if self.control.should_evaluate else Decision.CONTINUE

    def checkpoint_state(self, step: int) -> dict:
        return {"trl_state": self._saved()}

    def on_save(self, step: int, path) -> None:
        payload = {"path": path}
        comp = self.trainer._comp
        if self.control.should_training_stop and comp is not None and comp.eval_data is not None:
            # the loop evaluates the last step after its checkpoint; TRL evaluates first, then saves
            self._deferred_save = payload
            return
        self.control.should_save = False
        self.event("on_save", checkpoint=payload.get("path"))

    def _flush_save(self) -> None:
        if self._deferred_save is not None:
            payload, self._deferred_save = self._deferred_save, None
            self.control.should_save = False
            self.event("on_save", checkpoint=payload.get("path"))

    def on_evaluate(self, step: int, payload: dict) -> None:
        self.log_eval({f"eval_{k}": v for k, v in payload.items()})
        self._flush_save()

    def on_train_end(self, step: int) -> None:
        self._flush_save()
        self._at(step)
        self.event("on_epoch_end")

    def _step_begin(self) -> None:
        self.control._new_step()
        self.event("on_step_begin")

    def _flow(self, step: int, *, last_update: bool) -> None:
        """What transformers' DefaultFlowCallback sets before the callbacks' on_step_end: the cohort step's
        logging, evaluation and checkpoint when they are due (they happen after its last update)."""
        c, r, t = self.control, self.trainer.config.run, self.trainer.config.train
        if not last_update:
            return
        c.should_log = bool(r.logging_steps and step % r.logging_steps == 0)
        c.should_evaluate = bool(r.eval_steps and step % r.eval_steps == 0)
        c.should_save = bool((r.save_steps and step % r.save_steps == 0) or (step >= t.max_steps and r.save_at_end))
        if step >= t.max_steps:
            c.should_training_stop = True

    def _window(self) -> dict[str, Any]:
        """The row TRL logs for the steps since its last row: each metric's mean over them (NaNs left out, None
        when all are NaN, as TRL's GRPOTrainer.log), the latest value of the per-step and cumulative ones."""
        rows, self._pending = self._pending, []
        out: dict[str, Any] = {}
        for key in dict.fromkeys(k for row in rows for k in row):
            values = [row[key] for row in rows if key in row]
            if key in _LATEST or not all(isinstance(v, int | float) for v in values):
                out[key] = values[-1]
                continue
            finite = [float(v) for v in values if not math.isnan(v)]
            out[key] = sum(finite) / len(finite) if finite else None
        return out

    def _saved(self) -> dict[str, Any]:
        """The TrainerState a checkpoint keeps, as strict JSON (a NaN or inf metric becomes {"nonfinite": text})."""
        return {name: _to_json(getattr(self.state, name)) for name in _SAVED_FIELDS}

    def _restore(self, saved: dict[str, Any]) -> None:
        """Back to the saved TrainerState, in place (the trainer and the reward functions hold this object)."""
        names = {f.name for f in dataclasses.fields(self.state)}
        for name, value in saved.items():
            if name in names:
                setattr(self.state, name, _from_json(value))

    def log(self, logs: dict[str, Any]) -> None:
        """transformers' Trainer.log: the row with "epoch" (and "step" in log_history), then on_log."""
        logs = {**{k: _plain(v) for k, v in logs.items()}, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control.should_log = False
        self.event("on_log", logs=logs)

    def log_eval(self, metrics: dict[str, float]) -> None:
        self.log(metrics)
        self.control.should_evaluate = False
        self.event("on_evaluate", metrics=metrics)

    def finish(self, runtime_s: float, steps_done: int) -> None:
        """TRL's closing row (train_runtime, train_loss, ... over this train() call's steps) and on_train_end."""
        cfg = self.trainer.config
        completions = steps_done * cfg.completions_per_step
        updates = steps_done * self.per_gen
        # TRL's closing row also carries the mean metrics of the steps since the last logged row (its
        # GRPOTrainer.log merges what it has gathered into any row); loss, grad_norm and learning_rate come
        # from transformers' step logging, which the closing row does not have
        unlogged = {k: v for k, v in self._window().items() if k not in ("loss", "grad_norm", "learning_rate")}
        self.log({"train_runtime": runtime_s, "train_samples_per_second": completions / max(runtime_s, 1e-9),
                  "train_steps_per_second": updates / max(runtime_s, 1e-9),
                  "total_flos": self.state.total_flos,  # not counted by cohort: 0, as TRL's GRPO reports it
                  "train_loss": sum(self._losses) / len(self._losses) if self._losses else float("nan"),
                  **unlogged})
        self._losses.clear()
        self.event("on_train_end")


def _to_json(value: Any) -> Any:
    """Checkpoints hold strict JSON (no NaN): non-finite floats are written as {"nonfinite": "nan"|"inf"|"-inf"}."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"nonfinite": repr(value)}
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"nonfinite"}:
            return float(value["nonfinite"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    try:
        return float(value) if not isinstance(value, bool | int | str) else value
    except (TypeError, ValueError):
        return value

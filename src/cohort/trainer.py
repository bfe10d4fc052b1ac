"""The GRPO training loop, one readable function over the stages.

    for each step:
        prompts   = sampler.next()                         (resumable, seeded order)
        rollouts  = collect_rollouts(engine, prompts, ...)  (generate G each, score, advantages)
        metrics   = updater.update(rollouts)                 (mini-batches x iterations, packed micro-batches)
        engine.sync_weights()                                (no-op when the engine reads weights in place)
        log, evaluate, checkpoint

`build_components` (cohort.setup) turns a `CohortConfig` into the built objects the loop needs (`Components`,
fixed after set-up); what moves as the run goes on is its `RunState`, which is what a checkpoint saves.
Callbacks (`cohort.run.callbacks`) observe the loop and return typed decisions. Neither the loop nor set-up
knows any loss-type name. Everything that can fail on a bad input fails in `build_components`, before the
run directory is created.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cohort import checkpointing as ckpt
from cohort import distributed
from cohort.config import CohortConfig, dump_config
from cohort.data import PromptBatch, PromptSampler
from cohort.distributed.grad_sync import GradientReducer
from cohort.evaluation import evaluate
from cohort.remote.pipeline import RolloutPipeline
from cohort.rollout import collect_rollouts
from cohort.run.callbacks import Callback, CallbackList, Decision
from cohort.run.directory import open_run_dir, write_resolved_config
from cohort.run.logging import MetricLogger
from cohort.run.samples import cell, sample_prompt
from cohort.run.seeding import seed_everything, set_deterministic
from cohort.run.state import RunState
from cohort.run.timing import PhaseTimer
from cohort.setup import Components, build_components
from cohort.streaming import StreamingRollouts, resident_engine, token_staleness
from cohort.types import TrainerState
from cohort.update import PolicyUpdater

__all__ = ["Callback", "Decision", "TrainResult", "describe_schedule", "seed_everything", "train"]


@dataclass
class TrainResult:
    run_dir: Path
    history: list[dict[str, float]] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    stopped_at: int | None = None  # the step a time limit stopped the run at (resume to continue)


@dataclass
class _Progress:
    """The loop's moving parts: the run's state (what a checkpoint saves) and the last step's sample rows."""

    state: RunState = field(default_factory=RunState)
    samples: list[dict] = field(default_factory=list)


def describe_schedule(cfg: CohortConfig) -> str:
    t, g = cfg.train, cfg.generation
    n = cfg.completions_per_step
    per_update = n // t.mini_batches
    return (
        f"schedule: {t.max_steps} steps x {t.prompts_per_step} prompts x {g.num_generations} completions "
        f"= {n} completions/step; {t.mini_batches} optimiser update(s) of {per_update} completions "
        f"x {t.num_iterations} pass(es) = {t.mini_batches * t.num_iterations} updates/step, "
        f"{t.max_steps * t.mini_batches * t.num_iterations} in all; micro-batches of <= {t.token_budget} tokens"
        + ("; each row holds a prompt once before its completions (train.share_prompts; prompts with images "
           "keep a copy per completion)" if t.share_prompts and g.num_generations > 1 else "")
        + (f"; train.async_rollouts: each step trains on the first {t.prompts_per_step} groups to finish, up to "
           f"{(t.max_staleness + 1) * t.prompts_per_step} in flight" if t.async_rollouts else "")
    )


def _next_prompts(comp: Components, sampler: PromptSampler):
    """The step's prompts: every rank draws the same global indices and keeps its own contiguous slice."""
    def take(count: int) -> PromptBatch:
        idx = sampler.take(count * distributed.current().world_size)
        return comp.train_data.batch(distributed.rank_slice(idx))
    return take


def train(cfg: CohortConfig, components: Components | None = None, *, echo=print,
          callbacks: Sequence[Callback] = ()) -> TrainResult:
    cfg.validate()
    seed_everything(cfg.train.seed)
    set_deterministic(cfg.train.deterministic)
    info = distributed.current()
    distributed.check_layout(cfg.train.prompts_per_step, cfg.train.mini_batches)
    if not info.is_main:  # rank 0 alone writes the run directory; the others train beside it
        echo = _silent
    with distributed.phase("setup"):
        comp = components or build_components(cfg, echo=echo)
    echo(describe_schedule(cfg))
    hooks = CallbackList(callbacks)
    if not info.is_main:
        distributed.barrier()  # rank 0 has prepared the run directory (resume reads its checkpoints)
        return _train_in(cfg, comp, Path(cfg.run.output_dir), echo, hooks)
    with open_run_dir(cfg.run.output_dir, resume=bool(cfg.run.resume), overwrite=cfg.run.overwrite) as run_dir:
        distributed.barrier()
        return _train_in(cfg, comp, run_dir, echo, hooks)


def _silent(*args, **kwargs) -> None:
    pass


class _NoLogger:
    """What ranks other than 0 log to."""

    def log(self, *args, **kwargs) -> None:
        pass

    log_samples = log
    close = log


def _train_in(cfg: CohortConfig, comp: Components, run_dir: Path, echo, hooks: CallbackList) -> TrainResult:
    t, main = cfg.train, distributed.current().is_main
    if main:
        write_resolved_config(run_dir, cfg.to_dict())
    sampler = PromptSampler(len(comp.train_data), t.prompts_per_step, seed=t.seed, shuffle=cfg.data.shuffle)
    updater = _updater(comp, hooks)
    result, started, progress = TrainResult(run_dir=run_dir), time.monotonic(), _Progress()
    if cfg.run.resume:
        progress.state = _resume(cfg, comp, run_dir, sampler, echo, updater, hooks)
        result.eval_before = progress.state.eval_before
    start_step = step = progress.state.step
    logger = MetricLogger(run_dir, total_steps=t.max_steps, report_to=cfg.run.report_to,
                          start_step=start_step) if main else _NoLogger()
    pipeline: RolloutPipeline | StreamingRollouts | None = None
    try:
        hooks.notify("on_train_begin", start_step)
        _evaluate_before(cfg, comp, result, start_step, echo)
        # background rollouts start only now: started first, the first steps' requests shared the served engine's
        # batches with the greedy evaluation and changed its step-0 accuracy (docs/benchmarks.md)
        pipeline = _pipeline(cfg, comp, sampler, start_step)  # max_staleness >= 1 (server) or async_rollouts
        stop = False
        while step < t.max_steps and not stop and not _budget_spent(cfg, progress.state):
            step += 1
            hooks.notify("on_step_begin", step)
            metrics = _step(cfg, comp, sampler, updater, step, pipeline, progress)
            if step == start_step + 1:  # prompt truncation/drop counts, logged with the first step
                metrics.update(getattr(comp.train_data.stats, "as_metrics", dict)())
            result.history.append(metrics)
            if step == 1 and result.eval_before:  # logged only once a step succeeded: a run that fails
                # at step 1 (e.g. a broken reward function) leaves no run directory behind
                logger.log(0, {f"eval/{k}": v for k, v in result.eval_before.items()})
            last = step == t.max_steps or _budget_spent(cfg, progress.state)
            with distributed.phase("log", step):
                out_of_time = distributed.any_rank(
                    cfg.run.time_limit_s is not None and time.monotonic() - started > cfg.run.time_limit_s)
                _record(cfg, comp, logger, step, metrics, progress.samples, last=last,
                        requested=Decision.EVALUATE in hooks.decide("before_log", step))
            decision = hooks.decide("on_log", step, metrics)
            stop = Decision.STOP in decision  # a callback asked to stop: end here as at max_steps
            _maybe_save(cfg, comp, run_dir, step, sampler, pipeline, progress, result, updater, hooks, echo,
                        last=last or stop, out_of_time=out_of_time, asked=Decision.SAVE in decision)
            if out_of_time and not (last or stop):
                echo(f"run.time_limit_s={cfg.run.time_limit_s} reached after step {step}: checkpoint saved; "
                     "continue with --resume")
                result.stopped_at = step
                return result
        _finish(cfg, comp, result, logger, step, stopped=stop, state=progress.state, echo=echo, hooks=hooks)
    finally:
        logger.close()
        if pipeline is not None:
            pipeline.close()
    return result


def _updater(comp: Components, hooks: CallbackList) -> PolicyUpdater:
    updater = PolicyUpdater(comp.policy, comp.optimizer, comp.scheduler, comp.loss_fn, comp.update_settings,
                            reference=comp.reference, device=comp.device, grad_reducer=_grad_reducer(comp))
    if hooks:
        updater.on_update = lambda event: hooks.notify("on_update", updater.step, event)
    return updater


def _grad_reducer(comp: Components) -> GradientReducer | None:
    """Unsharded data parallel: a reducer that sums gradient buckets over ranks while backward runs."""
    if not distributed.current().enabled or comp.update_settings.sharded:
        return None
    return GradientReducer([p for p in comp.policy.parameters() if p.requires_grad])


def _evaluate_before(cfg: CohortConfig, comp: Components, result: TrainResult, start_step: int, echo) -> None:
    if start_step == 0 and comp.eval_data is not None and distributed.current().is_main:
        with distributed.phase("eval", 0):
            result.eval_before = evaluate(comp, cfg)
        echo("eval before training: " + _fmt(result.eval_before))


def _maybe_save(cfg: CohortConfig, comp: Components, run_dir: Path, step: int, sampler, pipeline,
                progress: _Progress, result: TrainResult, updater: PolicyUpdater, hooks: CallbackList, echo, *,
                last: bool, out_of_time: bool, asked: bool) -> None:
    """The step's checkpoint when one is due: run.save_steps, the last step (run.save_at_end), the time limit,
    or a callback's SAVE (the ranks agree: sharded saves are collective)."""
    requested = bool(hooks) and distributed.any_rank(asked)
    due = (cfg.run.save_steps and step % cfg.run.save_steps == 0) or (last and cfg.run.save_at_end)
    if not (due or out_of_time or requested):
        return
    progress.state.hooks = hooks.checkpoint_state(step)
    saved = None
    if distributed.current().is_main or cfg.train.sharding == "fsdp":  # sharded: every rank writes its shards
        with distributed.phase("save", step):
            saved = _save(cfg, comp, run_dir, step, _checkpoint_sampler(sampler, pipeline, step), result,
                          updater, progress.state)
        if saved is not None:  # (the benchmarks replace _save by a no-op)
            echo(f"checkpoint {saved.name}: {ckpt.describe_size(saved)}")
    hooks.notify("on_save", step, saved)


def _finish(cfg: CohortConfig, comp: Components, result: TrainResult, logger, step: int, *, stopped: bool,
            state: RunState, echo, hooks: CallbackList) -> None:
    """After the last step: say why the loop ended early, the final held-out evaluation, the callbacks."""
    if step < cfg.train.max_steps and not stopped:  # the loop ended on train.max_train_time_s
        echo(f"train.max_train_time_s={cfg.train.max_train_time_s} of training reached after step {step} "
             f"({state.train_time_s:.0f} s of step time): final checkpoint saved")
    if comp.eval_data is not None and distributed.current().is_main:
        with distributed.phase("eval", step):
            result.eval_after = evaluate(comp, cfg)
        logger.log(step, {f"eval/{k}": v for k, v in result.eval_after.items()})
        echo("eval after training:  " + _fmt(result.eval_after))
        hooks.notify("on_evaluate", step, result.eval_after)
    hooks.notify("on_train_end", step)


def _resume(cfg: CohortConfig, comp: Components, run_dir: Path, sampler, echo, updater: PolicyUpdater,
            hooks: CallbackList) -> RunState:
    """Load the newest complete checkpoint into the live objects; its run state (step 0 when none)."""
    # run.resume: true resumes from the newest checkpoint, a path from that checkpoint folder
    latest = ckpt.latest_checkpoint(run_dir) if cfg.run.resume is True else Path(str(cfg.run.resume))
    if latest is None:
        return RunState()
    with_optimizer = ckpt.has_optimizer_state(latest)
    if not with_optimizer:  # saved with run.save_only_model: weights only, Adam restarts (docs/training.md)
        echo(f"{latest} holds no optimizer state (saved with run.save_only_model=true): resuming the weights, "
             "data position, learning-rate schedule and RNG; Adam's moments restart from zero, so the run "
             "will not match an uninterrupted one exactly")
    saved = ckpt.load_checkpoint(latest, model=comp.policy, optimizer=comp.optimizer if with_optimizer else None,
                                 scheduler=comp.scheduler)
    state = RunState.from_trainer_state(saved)
    updater.nonfinite_streak = state.nonfinite_streak
    sampler.load_state_dict(state.sampler)
    comp.engine.sync_weights()
    echo(f"resumed from {latest} at step {state.step}")
    hooks.notify("on_resume", state.step, dict(state.hooks))
    return state


def _record(cfg: CohortConfig, comp: Components, logger, step: int, metrics: dict, samples: list[dict], *,
            last: bool, requested: bool = False) -> None:
    """Periodic held-out evaluation (rank 0; the final one happens after the loop; `requested`: a callback
    asked for one at this step), metrics, sample rows."""
    due = ((cfg.run.eval_steps and step % cfg.run.eval_steps == 0) or requested) and not last
    if comp.eval_data is not None and due and distributed.current().is_main:
        with distributed.phase("eval", step):
            metrics.update({f"eval/{k}": v for k, v in evaluate(comp, cfg).items()})
    logger.log(step, metrics)
    if cfg.run.log_completions:
        logger.log_samples(step, samples)


def _budget_spent(cfg: CohortConfig, state: RunState) -> bool:
    """train.max_train_time_s: training ends (final checkpoint, final eval) once this much step time is spent."""
    limit = cfg.train.max_train_time_s
    return limit is not None and state.train_time_s >= limit


def _step_params(cfg: CohortConfig, comp: Components, step: int):
    """The sampling parameters of `step`. A seed per step makes sampling a function of (seed, step), whatever RNG
    state the engine keeps: a resumed run samples exactly what the uninterrupted run sampled. Data parallelism:
    rank r holds global prompts [r * local, (r + 1) * local), and the seed offset makes completion j of global
    prompt i use the same seed as on one rank."""
    info = distributed.current()
    local = cfg.train.prompts_per_step // info.world_size
    seed = (cfg.train.seed * 1_000_003 + step * 7_919) % 2**31 + info.rank * local * comp.sampling_params.n
    return dataclasses.replace(comp.sampling_params, seed=seed)


def _collect(cfg: CohortConfig, comp: Components, sampler, step: int, gather=None, engine=None, prompts=None):
    """The rollouts of `step`: its prompts, G completions each, rewards and advantages. `gather`: how rewards
    are gathered over ranks (default: distributed.all_gather_rows, on the default group). `engine` / `prompts`:
    what samples and the prompts' source, when not comp.engine and the sampler (streamed groups)."""
    info = distributed.current()
    local = cfg.train.prompts_per_step // info.world_size
    params = _step_params(cfg, comp, step)
    return collect_rollouts(
        engine or comp.engine, comp.tokenizer, prompts or _next_prompts(comp, sampler), local,
        params, comp.reward_runner, advantage_kwargs=comp.advantage_kwargs,
        trainer_state=TrainerState(global_step=step, max_steps=cfg.train.max_steps),
        dynamic_sampling=cfg.reward.dynamic_sampling, max_resample_tries=cfg.reward.max_resample_tries,
        max_oversample=cfg.reward.max_oversample,
        mask_truncated_completions=cfg.generation.mask_truncated_completions,
        gather_rewards=(gather or distributed.all_gather_rows) if info.enabled else None, rank=info.rank,
        turn_loop=comp.turn_loop)


def _pipeline(cfg: CohortConfig, comp: Components, sampler,
              start_step: int) -> RolloutPipeline | StreamingRollouts | None:
    """train.max_staleness = k >= 1: the rollouts of steps t+1..t+k are collected in a background thread while
    step t trains (cohort.remote.pipeline); None for k = 0 (generation in the loop's own thread, on-policy).
    train.async_rollouts: groups streamed from the colocated engine, k bounding staleness (cohort.streaming)."""
    k = cfg.train.max_staleness
    if cfg.train.async_rollouts:
        return StreamingRollouts(
            resident_engine(comp.engine), _next_prompts(comp, sampler), lambda s: _step_params(cfg, comp, s),
            lambda s, done, take: _collect(cfg, comp, sampler, s, engine=done, prompts=take), sampler,
            prompts_per_step=cfg.train.prompts_per_step // distributed.current().world_size, max_staleness=k,
            start_step=start_step, max_steps=cfg.train.max_steps)
    if k == 0:
        return None
    # Several ranks: each pipelines its own slice of every step against the server (rank 0 pushes, the others'
    # requests wait for its pushes). The background thread's reward gathers go over a group of their own:
    # on the default group they would interleave with the update's collectives in a different order per rank.
    gather = distributed.thread_gatherer(cfg.train.dist_timeout_s) if distributed.current().enabled else None
    return RolloutPipeline(comp.engine, lambda s: _collect(cfg, comp, sampler, s, gather), sampler,
                           start_step=start_step, max_steps=cfg.train.max_steps, max_staleness=k)


def _checkpoint_sampler(sampler, pipeline, step: int):
    """What a checkpoint after `step` saves as the data position (the pipeline's sampler runs ahead)."""
    return sampler if pipeline is None else pipeline.checkpoint_sampler(step)


def _step(cfg: CohortConfig, comp: Components, sampler, updater: PolicyUpdater, step: int,
          pipeline=None, progress: _Progress | None = None) -> dict[str, Any]:
    progress = progress if progress is not None else _Progress()
    timer = PhaseTimer()
    t0 = time.perf_counter()
    with distributed.phase("generate", step), timer("generate"):  # scoring too: collect_rollouts rewards
        # with the pipeline (train.max_staleness >= 1): the wait for rollouts made in the background
        batch = pipeline.get(step) if pipeline is not None else _collect(cfg, comp, sampler, step)
    metrics: dict[str, Any] = distributed.reduce_metrics(dict(batch.metrics))
    engine, can = comp.engine, comp.abilities
    if batch.policy_versions is not None:  # served or streamed: tokens' versions behind the one this step trains from
        version = engine.version if can.versioned else pipeline.version  # type: ignore[attr-defined]
        metrics.update(distributed.reduce_metrics(token_staleness(batch, version)))
    if cfg.generation.release_kv_during_update and can.releases_kv:
        engine.release_kv_cache()  # type: ignore[attr-defined]  # its next generate takes it back
    with distributed.phase("update", step):
        updater.step = step
        metrics.update(updater.update(batch, timer))
        with timer("sync_weights"):
            engine.sync_weights()
    if can.gathers_weights:  # FSDP: the all-gather into the engine's weights
        timer.record("weight_gather", engine.weights.seconds)  # type: ignore[attr-defined]
    if can.versioned:  # server placement: the push alone, without the switch's wait (0 on ranks that do not push)
        pushed = engine.last_push  # type: ignore[attr-defined]
        timer.record("weight_push", pushed.get("send_s", 0.0) + pushed.get("apply_s", 0.0))
    metrics.update(distributed.reduce_metrics(timer.pop()))
    state = progress.state
    state.num_tokens += int(distributed.all_sum(sum(len(p) + len(c) for p, c in zip(batch.prompt_ids,
                                                                                     batch.completion_ids))))
    metrics["num_tokens"] = state.num_tokens
    # the slowest rank's time, so every rank agrees on time budgets and stops at the same step
    metrics["step_time"] = distributed.reduce_metrics({"step_time": time.perf_counter() - t0})["step_time"]
    state.train_time_s += metrics["step_time"]
    metrics["train_time"] = state.train_time_s  # cumulative over resumes: "accuracy after N minutes"
    state.step, state.nonfinite_streak = step, updater.nonfinite_streak
    progress.samples = [
        {"step": step, "prompt": sample_prompt(p), "completion": c, "reward": float(r), "advantage": float(a),
         **{name: cell(column[i]) for name, column in batch.extra_columns.items()}}  # log_extra's columns
        for i, (p, c, r, a) in enumerate(zip(batch.prompts, batch.completions_text, batch.rewards, batch.advantages))
    ]
    return metrics


def _save(cfg: CohortConfig, comp: Components, run_dir: Path, step: int, sampler, result: TrainResult,
          updater: PolicyUpdater | None = None, state: RunState | None = None) -> Path:
    state = dataclasses.replace(state or RunState(), step=step, sampler=sampler.state_dict(),
                                eval_before=result.eval_before,
                                nonfinite_streak=updater.nonfinite_streak if updater is not None else 0)
    return ckpt.save_checkpoint(
        run_dir, step, model=comp.policy, tokenizer=comp.processor or comp.tokenizer,
        optimizer=None if cfg.run.save_only_model else comp.optimizer,
        scheduler=comp.scheduler, keep_last=cfg.run.save_total_limit,
        trainer_state=state.to_trainer_state(dump_config(cfg)))


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.4g}" for k, v in metrics.items())

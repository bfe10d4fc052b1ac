"""The evaluation before training sees an idle engine: with train.max_staleness >= 1 (a background rollout
thread against `cohort serve`) or train.async_rollouts (streamed groups), no rollout for step 1 starts before that
evaluation ends. Started earlier, the first steps' requests shared the served engine's batches with the greedy
evaluation and changed its step-0 accuracy (calculator agent served, k = 1 and 2: 26.5-28% against 29.5% at
k = 0; docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import threading

from tests.integration.test_serving_training import _components, _config, served  # noqa: F401 (the fixture)
from tests.integration.test_trainer_learns import toy_components, toy_config

import cohort.trainer
from cohort.trainer import train


def record_evaluation_and_rollouts(monkeypatch) -> list[str]:
    """Events in order: "collect" for every rollout collection started, and for the evaluation before training
    the rollout threads alive while it ran (a thread alive then could be mid-request, whatever the order)."""
    events: list[str] = []
    collect = cohort.trainer._collect
    monkeypatch.setattr(cohort.trainer, "_collect", lambda *a, **k: events.append("collect") or collect(*a, **k))

    def evaluate(comp, cfg):
        running = [t.name for t in threading.enumerate() if t.name.startswith("cohort-rollout")]
        events.append(f"eval running={running}")
        return {"accuracy": 0.5}

    monkeypatch.setattr(cohort.trainer, "evaluate", evaluate)
    return events


def _check(events: list[str], result) -> None:
    assert events[0] == "eval running=[]", events
    assert "collect" in events and result.eval_before == {"accuracy": 0.5}
    assert len(result.history) == 2


def test_streamed_rollouts_start_after_the_evaluation_before_training(tmp_path, monkeypatch):
    cfg = toy_config(tmp_path, steps=2)
    cfg.train.async_rollouts, cfg.train.max_staleness = True, 1
    comp = toy_components(cfg)
    comp = dataclasses.replace(comp, eval_data=comp.train_data)
    events = record_evaluation_and_rollouts(monkeypatch)
    _check(events, train(cfg, comp, echo=lambda *a, **k: None))


def test_served_background_rollouts_start_after_the_evaluation_before_training(tmp_path, monkeypatch, request):
    model_dir, server = request.getfixturevalue("served")  # test_serving_training's module-wide server
    cfg = _config(tmp_path, "k1", steps=2, server=server, staleness=1)
    comp = _components(cfg, model_dir)
    comp = dataclasses.replace(comp, eval_data=comp.train_data)
    events = record_evaluation_and_rollouts(monkeypatch)
    _check(events, train(cfg, comp, echo=lambda *a: None))

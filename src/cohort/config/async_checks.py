"""Checks of `train.async_rollouts` (streamed groups, partial rollouts on the colocated engine) against the
settings it cannot run with yet; each error names the field, the value and the fix (cohort.config.checks calls it
from its placement checks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cohort.config.checks import _require

if TYPE_CHECKING:
    from cohort.config.tree import CohortConfig


def check_async_rollouts(cfg: CohortConfig) -> None:
    t, g = cfg.train, cfg.generation
    _require(isinstance(t.async_rollouts, bool), "train.async_rollouts", t.async_rollouts, "use true or false")
    if not t.async_rollouts:
        return
    _require(g.placement == "colocate", "train.async_rollouts", t.async_rollouts,
             "it streams groups on the colocated engine; with generation.placement=server the rollouts of later "
             "steps already overlap training through train.max_staleness: set train.async_rollouts=false")
    _require(not cfg.reward.dynamic_sampling, "reward.dynamic_sampling", cfg.reward.dynamic_sampling,
             "DAPO's filter resamples a step's groups, which streamed rollouts do not do yet: set "
             "reward.dynamic_sampling=false or train.async_rollouts=false")
    _require(not cfg.agent.tools and cfg.agent.environment_factory is None, "train.async_rollouts", t.async_rollouts,
             "streamed rollouts are single-turn: turn it off with agent.tools or agent.environment_factory")
    _require(cfg.advantage.estimator != "remax", "advantage.estimator", cfg.advantage.estimator,
             "remax samples a greedy baseline beside each step's groups, which streamed rollouts do not: choose "
             "another estimator or set train.async_rollouts=false")
    _require(not g.release_kv_during_update, "generation.release_kv_during_update", g.release_kv_during_update,
             "with train.async_rollouts the engine keeps unfinished sequences (and their KV) through the update: "
             "set it to false")
    if t.max_staleness > 0:
        correction = cfg.loss.params.get("sampler_is_correction", True)
        _require(correction is not False, "loss.sampler_is_correction", correction,
                 f"train.max_staleness={t.max_staleness} trains on tokens sampled with older weights; the sampler "
                 "importance weights are what correct for it, keep loss.sampler_is_correction=true")

"""Pacing of asynchronous rollouts (cohort.streaming.pacing) on simulated long-tailed groups, the per-token
staleness metric, and the config rules of train.async_rollouts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.streaming import Pacer, token_staleness


@dataclass(eq=False)
class _Group:
    admitted: int
    left: int  # engine ticks until it finishes
    finished_at: int | None = None


def _simulate(per_step: int, k: int, steps: int, seed: int) -> list[list[_Group]]:
    """Steps of a stream whose groups take log-normal numbers of ticks; returns each step's groups."""
    rng, pacer = random.Random(seed), Pacer(per_step, k)
    resident: list[_Group] = []
    finished, taken = 0, []
    for version in range(steps):
        for _ in range(pacer.room(len(resident))):
            resident.append(_Group(version, max(1, int(rng.lognormvariate(2.0, 1.2)))))
        needs = pacer.needs(resident, version)
        assert all(need <= per_step for need in needs)  # the invariant the admission bound keeps
        while (chosen := pacer.select(resident, version)) is None:
            for g in resident:  # one engine tick: every unfinished group decodes
                if g.finished_at is None:
                    g.left -= 1
                    if g.left == 0:
                        g.finished_at, finished = finished, finished + 1
        assert len(chosen) == per_step and len(set(map(id, chosen))) == per_step
        assert all(version - g.admitted <= k for g in chosen)  # the staleness bound
        assert all(version - g.admitted < k for g in resident if g not in chosen)  # none left past its bound
        resident = [g for g in resident if g not in chosen]
        taken.append(chosen)
    return taken


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_every_step_trains_p_groups_none_staler_than_k(k):
    for seed in range(5):
        _simulate(per_step=3, k=k, steps=30, seed=seed)


def test_staleness_zero_takes_exactly_the_groups_it_admitted():
    for version, groups in enumerate(_simulate(per_step=4, k=0, steps=10, seed=1)):
        assert {g.admitted for g in groups} == {version}


def test_with_room_to_spare_a_step_takes_groups_as_they_finish():
    pacer = Pacer(per_step=2, max_staleness=2)
    groups = [_Group(0, 0, finished_at=f) for f in (None, 3, 1, None, 0, 2)]
    assert pacer.select(groups, version=0) == [groups[4], groups[2]]  # finished first, taken first
    assert pacer.select(groups[:2], version=0) is None  # fewer than P finished


def test_a_group_at_its_bound_is_waited_for():
    pacer = Pacer(per_step=2, max_staleness=1)
    old, new = _Group(0, 0), [_Group(1, 0, finished_at=i) for i in range(3)]
    assert pacer.forced([old, *new], version=1) and pacer.select([old, *new], version=1) is None
    old.finished_at = 9
    assert pacer.select([old, *new], version=1) == [old, new[0]]
    assert pacer.capacity() == 4 and pacer.room(3) == 1 and pacer.room(5) == 0


def _batch(ids, token_versions=None, versions=None, masks=None):
    return SimpleNamespace(completion_ids=ids, token_versions=token_versions, policy_versions=versions,
                           completion_masks=masks)


def test_staleness_is_counted_over_sampled_tokens():
    ids = [[5, 6, 7, 8], [9, 9]]
    # completion 0 per token: 1, 1, (context: not counted), 0; completion 1 has one version for both tokens: 2, 2
    batch = _batch(ids, token_versions=[[4, 4, 5, 5], None], versions=[4, 3], masks=[[1, 1, 0, 1], None])
    assert token_staleness(batch, current=5) == {"staleness/mean": pytest.approx(6 / 5), "staleness/max": 2.0}
    # a served engine: one version per completion, weighted by its tokens
    assert token_staleness(_batch(ids, versions=[5, 2]), current=5) == {"staleness/mean": 1.0,
                                                                        "staleness/max": 3.0}
    assert token_staleness(_batch(ids), current=5) == {}


def _cfg(**changes) -> CohortConfig:
    cfg = CohortConfig()
    cfg.train.async_rollouts = True
    for key, value in changes.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.mark.parametrize(("changes", "named"), [
    ({"generation__placement": "server", "generation__server_address": "127.0.0.1:8000"}, "train.async_rollouts=True"),
    ({"reward__dynamic_sampling": True}, "reward.dynamic_sampling=True"),
    ({"agent__tools": ["math:sqrt"]}, "train.async_rollouts=True"),
    ({"advantage__estimator": "remax"}, "advantage.estimator='remax'"),
    ({"generation__release_kv_during_update": True}, "generation.release_kv_during_update=True"),
    ({"train__async_rollouts": "yes"}, "train.async_rollouts='yes'"),
])
def test_settings_async_rollouts_cannot_run_with_are_refused_by_name(changes, named):
    with pytest.raises(ConfigError, match="is not valid") as err:
        _cfg(**changes).validate()
    assert named in str(err.value)


def test_max_staleness_on_the_colocated_engine_needs_async_rollouts():
    _cfg(train__max_staleness=2).validate()
    with pytest.raises(ConfigError, match=r"train\.async_rollouts=true on the colocated engine"):
        _cfg(train__max_staleness=2, train__async_rollouts=False).validate()
    cfg = _cfg(train__max_staleness=1)
    cfg.loss.params["sampler_is_correction"] = False
    with pytest.raises(ConfigError, match=r"loss\.sampler_is_correction=False"):
        cfg.validate()

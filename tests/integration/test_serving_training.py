"""Training against `cohort serve` (generation.placement=server) on the CPU: with train.max_staleness=0 the run
equals the colocated one step for step; with max_staleness=1 generation runs ahead by one step and every
completion was sampled with weights at most one version behind the ones it trains."""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.serving import ServerProcess
from tests.helpers.toy_task import digit_share, toy_rows, write_toy_workspace
from tests.integration.test_trainer_learns import toy_config

from cohort.config import CohortConfig
from cohort.data import load_prompt_dataset
from cohort.errors import CohortError, ConfigError
from cohort.policy.model import load_policy
from cohort.rewards import RewardRunner
from cohort.serving import RemoteEngine
from cohort.setup import build_components
from cohort.trainer import train

TIMING = ("time/", "step_time", "train_time", "staleness/")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir, _ = write_toy_workspace(tmp_path_factory.mktemp("served_training"))
    proc = ServerProcess(model_dir)
    yield model_dir, proc
    proc.kill()


def _components(cfg: CohortConfig, model_dir):
    policy, tok = load_policy(str(model_dir), dtype=torch.float32)
    data = load_prompt_dataset(toy_rows()).encode(tok, 64)
    return build_components(cfg, policy=policy, tokenizer=tok, reward_runner=RewardRunner([digit_share]),
                            train_data=data, echo=lambda *a: None)


def _config(tmp_path, name: str, steps: int, server=None, staleness: int = 0) -> CohortConfig:
    cfg = toy_config(tmp_path / name, steps=steps)
    if server is not None:
        cfg.generation.placement, cfg.generation.server_address = "server", server.address
        cfg.generation.server_timeout_s, cfg.generation.server_connect_timeout_s = 60.0, 10.0
    cfg.train.max_staleness = staleness
    return cfg


def _learning_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


def test_served_synchronous_run_equals_the_colocated_run(tmp_path, served):
    model_dir, server = served
    colocated = _config(tmp_path, "colocated", steps=3)
    remote = _config(tmp_path, "served", steps=3, server=server)
    expected = train(colocated, _components(colocated, model_dir), echo=lambda *a: None).history
    comp = _components(remote, model_dir)
    assert isinstance(comp.engine, RemoteEngine)
    got = train(remote, comp, echo=lambda *a: None).history
    assert len(got) == len(expected) == 3
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        assert _learning_metrics(a) == _learning_metrics(b), step  # exactly: same tokens, logprobs, losses
        assert a["staleness/max"] == 0.0 and a["staleness/mean"] == 0.0
    assert comp.engine.version == 3  # one push per step after the initial one
    assert "time/sync_weights" in got[-1]


def test_a_served_lora_run_follows_the_colocated_lora_run(tmp_path, served):
    """model.lora_r > 0 with a server: the pushes carry the merged weights (serving/lora_merge.py), so the
    served run samples what the colocated engine samples with the adapters unmerged, up to float rounding."""
    model_dir, server = served
    runs = []
    for name, srv in (("colocated_lora", None), ("served_lora", server)):
        cfg = _config(tmp_path, name, steps=3, server=srv)
        cfg.model.lora_r, cfg.model.lora_alpha = 4, 16
        cfg.train.learning_rate = 5e-3  # adapters move enough in 3 steps to change what is sampled
        runs.append(train(cfg, _components(cfg, model_dir), echo=lambda *a: None).history)
    colocated, served_run = runs
    assert len(served_run) == len(colocated) == 3
    for step, (a, b) in enumerate(zip(served_run, colocated), start=1):
        a, b = _learning_metrics(a), _learning_metrics(b)
        assert a.keys() == b.keys(), step
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5), step


def test_staleness_one_samples_at_most_one_version_behind(tmp_path, served):
    model_dir, server = served
    cfg = _config(tmp_path, "async", steps=4, server=server, staleness=1)
    comp = _components(cfg, model_dir)
    seen: list[tuple[int, int, list[int]]] = []  # (engine version when sampled, required, versions)
    generate = comp.engine.generate

    def recording(prompts, params):
        groups = generate(prompts, params)
        seen.append((comp.engine.version, comp.engine._required_version(), [c.version for g in groups for c in g]))
        return groups

    comp.engine.generate = recording
    push = comp.engine.sync_weights

    def push_after_the_next_generation():
        # make the overlap certain: step t's weights go out only once step t+1 has been sampled (as happens
        # whenever generating a step is faster than training one)
        step = comp.engine.version + 1
        deadline = time.monotonic() + 30
        while len(seen) < min(step + 1, cfg.train.max_steps) and time.monotonic() < deadline:
            time.sleep(0.01)
        push()

    comp.engine.sync_weights = push_after_the_next_generation
    history = train(cfg, comp, echo=lambda *a: None).history
    assert len(history) == 4 and len(seen) == 4
    for step, ((_, required, versions), row) in enumerate(zip(seen, history), start=1):
        trained_from = step - 1  # the version of the weights that step `step` updates
        assert required == trained_from - 1
        assert all(trained_from - 1 <= v <= trained_from for v in versions), (step, versions)
        assert 0.0 <= row["staleness/mean"] <= row["staleness/max"] <= 1.0
        assert "sampling/importance_sampling_ratio/mean" in row
    # generation ran ahead: every step after the first trained on completions of the previous version
    assert [row["staleness/max"] for row in history] == [0.0, 1.0, 1.0, 1.0]


def test_staleness_needs_server_placement(tmp_path):
    cfg = _config(tmp_path, "bad", steps=1, staleness=1)
    with pytest.raises(ConfigError, match=r"generation\.placement=server"):
        cfg.validate()


def _rank(rank: int, world: int, out: str, init_file: str, address: str | None, staleness: int = 0,
          steps: int = 2) -> None:
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist
    from tests.integration.test_trainer_learns import toy_components

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = toy_config(Path(out), steps=steps)
        cfg.train.device = "cpu"
        cfg.train.max_staleness = staleness
        if address is not None:
            cfg.generation.placement, cfg.generation.server_address = "server", address
        comp = toy_components(cfg)
        seen: list[dict] = []  # per generate call: the version it required, the versions it got
        generate = comp.engine.generate

        def recording(prompts, params):
            groups = generate(prompts, params)
            seen.append({"required": comp.engine._required_version(),
                         "versions": [c.version for g in groups for c in g]})
            return groups

        if address is not None:
            comp.engine.generate = recording
        train(cfg, comp, echo=lambda *a: None)
        Path(f"{out}/versions-{rank}.json").write_text(json.dumps(seen))
        torch.save({n: p.detach() for n, p in comp.policy.named_parameters()}, f"{out}/weights-{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_served_ranks_equal_one_colocated_rank(request, tmp_path, served):
    """Rank 0 pushes, rank 1 only counts versions and its requests wait for rank 0's push of the same run.
    About 50 s on 2 cores: runs with `-m slow` or COHORT_SLOW_TESTS=1."""
    import math
    import os

    if "slow" not in (request.config.option.markexpr or "") and not os.environ.get("COHORT_SLOW_TESTS"):
        pytest.skip("slow: run with -m slow or COHORT_SLOW_TESTS=1")

    import torch.multiprocessing as mp
    from tests.integration.test_distributed import COMPARED

    from cohort.run.logging import read_jsonl

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    mp.spawn(_rank, args=(1, str(one), str(tmp_path / "init1"), None), nprocs=1, join=True)
    mp.spawn(_rank, args=(2, str(two), str(tmp_path / "init2"), served[1].address), nprocs=2, join=True)
    a = {r["step"]: r for r in read_jsonl(one / "run" / "metrics.jsonl")}
    b = {r["step"]: r for r in read_jsonl(two / "run" / "metrics.jsonl")}
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        assert b[step]["staleness/max"] == 0.0
        for key in COMPARED:
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-4, abs_tol=1e-6), (step, key)
    w0, w1 = torch.load(two / "weights-0.pt"), torch.load(two / "weights-1.pt")
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


@pytest.mark.slow
def test_two_ranks_pipeline_their_own_prompts_at_most_k_behind(request, tmp_path, served):
    """train.max_staleness=1 with 2 gloo ranks: each rank's background thread generates its slice of the next
    step against the server (rank 0 pushes), its reward gathers on a group of its own; every completion of step
    s was sampled with version >= s - 2 (at most one behind the version s - 1 it trains from), and the run
    completes with the ranks' weights equal. About 60 s on 2 cores: runs with `-m slow` or COHORT_SLOW_TESTS=1."""
    import json
    import os

    if "slow" not in (request.config.option.markexpr or "") and not os.environ.get("COHORT_SLOW_TESTS"):
        pytest.skip("slow: run with -m slow or COHORT_SLOW_TESTS=1")

    import torch.multiprocessing as mp

    from cohort.run.logging import read_jsonl

    steps, k = 3, 1
    mp.spawn(_rank, args=(2, str(tmp_path), str(tmp_path / "init"), served[1].address, k, steps), nprocs=2,
             join=True)
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "staleness/max" in r}
    assert sorted(rows) == list(range(1, steps + 1))
    assert all(0.0 <= rows[s]["staleness/max"] <= k for s in rows)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"versions-{rank}.json").read_text())
        assert len(seen) == steps  # one generate per step (no dynamic sampling)
        for step, call in enumerate(seen, start=1):
            trained_from = step - 1
            assert call["required"] == trained_from - k
            assert all(trained_from - k <= v <= trained_from for v in call["versions"]), (rank, step, call)
    w0, w1 = torch.load(tmp_path / "weights-0.pt"), torch.load(tmp_path / "weights-1.pt")
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


def test_a_pipelined_checkpoint_saves_the_next_steps_data_position(tmp_path, served):
    """The pipeline's sampler runs ahead; a checkpoint after step 2 still holds the position step 3 starts from,
    the one a synchronous run saves."""
    import json

    model_dir, server = served
    states = {}
    for staleness in (0, 1):
        cfg = _config(tmp_path, f"k{staleness}", steps=3, server=server, staleness=staleness)
        cfg.run.save_steps, cfg.run.save_total_limit = 2, None
        train(cfg, _components(cfg, model_dir), echo=lambda *a: None)
        state = json.loads((tmp_path / f"k{staleness}" / "run" / "checkpoints" / "step-000002" /
                            "trainer_state.json").read_text())
        states[staleness] = state["sampler"]
    assert states[1] == states[0]


def test_an_error_in_the_background_generation_reaches_the_training_loop(tmp_path, served):
    model_dir, server = served
    cfg = _config(tmp_path, "failing", steps=4, server=server, staleness=1)
    calls = []

    def flaky(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # step 2's scoring, in the pipeline's thread
            raise RuntimeError("reward backend unavailable")
        return [0.0] * len(completions)

    policy, tok = load_policy(str(model_dir), dtype=torch.float32)
    comp = build_components(cfg, policy=policy, tokenizer=tok, reward_runner=RewardRunner([flaky]),
                            train_data=load_prompt_dataset(toy_rows()).encode(tok, 64), echo=lambda *a: None)
    with pytest.raises(CohortError, match="reward backend unavailable"):  # the RewardError naming the function
        train(cfg, comp, echo=lambda *a: None)

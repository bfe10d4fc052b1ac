"""FSDP with a server: two gloo ranks, the policy sharded (train.sharding=fsdp), train against `cohort serve`.
As in colocated FSDP, each rank's engine side holds a whole mirror of the policy that `sync_weights` refreshes
by all-gathering the shards (every rank takes part); rank 0 then pushes the mirror. The run equals one unsharded
colocated rank on the same global batch (the tolerance of tests/integration/test_fsdp.py), for a full fine-tune
and for LoRA (the mirror is pushed merged), and the server's sampling logprobs are the trainer's at every step:
a stale mirror fails this at step 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.gloo_ranks import join_gloo, leave_rank
from tests.helpers.serving import ServerProcess
from tests.helpers.toy_task import write_toy_workspace
from tests.integration.test_fsdp import COMPARED
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.run.logging import read_jsonl
from cohort.trainer import train


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir, _ = write_toy_workspace(tmp_path_factory.mktemp("served_fsdp"))
    proc = ServerProcess(model_dir)
    yield proc
    proc.kill()


def _rank(rank: int, world: int, out: str, init_file: str, address: str | None, lora: bool) -> None:
    join_gloo(rank, world, init_file)
    try:
        cfg = toy_config(Path(out), steps=2)
        cfg.train.device = "cpu"
        if lora:
            cfg.model.lora_r, cfg.model.lora_target_modules = 4, ["q_proj", "v_proj"]
        if address is not None:
            cfg.train.sharding = "fsdp"
            cfg.generation.placement, cfg.generation.server_address = "server", address
        comp = toy_components(cfg)
        history = train(cfg, comp, echo=lambda *a: None).history
        pushes = {"version": getattr(comp.engine, "version", None),
                  "gathers": [row.get("time/weight_gather") for row in history],
                  "buckets": getattr(comp.engine, "last_push", {}).get("buckets")}
        Path(f"{out}/engine-{rank}.json").write_text(json.dumps(pushes))
        from cohort import distributed

        distributed.shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_rank()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_two_fsdp_ranks_against_a_server_equal_one_colocated_rank(tmp_path, served, lora):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    mp.spawn(_rank, args=(1, str(one), str(tmp_path / "i1"), None, lora), nprocs=1, join=True)
    mp.spawn(_rank, args=(2, str(two), str(tmp_path / "i2"), served.address, lora), nprocs=2, join=True)
    a = {r["step"]: r for r in read_jsonl(one / "run" / "metrics.jsonl") if "reward" in r}
    b = {r["step"]: r for r in read_jsonl(two / "run" / "metrics.jsonl") if "reward" in r}
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        for key in COMPARED:
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-4, abs_tol=1e-6), (step, key)
        # the server sampled with the weights the trainer trains from: its logprobs are the trainer's (float32
        # rounding), which a stale or partial push would break at step 2
        assert b[step]["sampling/sampling_logp_difference/max"] < 1e-4, (step, b[step])
    for rank in (0, 1):
        engine = json.loads((two / f"engine-{rank}.json").read_text())
        assert engine["version"] == 2  # one push per step after the initial one, counted on both ranks
        assert all(g is not None and g >= 0 for g in engine["gathers"])  # both ranks took part in the gathers
    assert json.loads((two / "engine-0.json").read_text())["buckets"] >= 1  # rank 0 sent them

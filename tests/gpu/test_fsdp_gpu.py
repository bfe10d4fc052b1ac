"""FSDP2 on GPUs over NCCL (needs 2 CUDA devices): 2 sharded ranks train what 1 unsharded rank trains.

float32 weights, so the comparison is tight and tests the NCCL collectives, the per-unit gather into the
engine's mirror (CUDA graphs on the mirror's fixed buffers), and the sharded optimizer, not bf16 rounding.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.run.logging import read_jsonl
from cohort.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")
# the toy task is reasoning-gym's chain_sum; the GPU machines lack it unless its wheels are carried (.gl/rg)
pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install --no-deps .gl/rg/*.whl")


def _run(rank: int, world: int, out: str, port: int, sharding: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group("nccl")
    try:
        cfg = toy_config(Path(out), steps=3)
        cfg.model.dtype = "float32"
        cfg.train.sharding = sharding
        cfg.train.mini_batches = 2
        cfg.train.token_budget = 96
        cfg.advantage.scale_rewards = "batch"
        comp = toy_components(cfg)
        train(cfg, comp)
        if sharding == "fsdp":  # the engine's copy is the gathered policy
            from torch.distributed.tensor import DTensor

            mirror = dict(comp.engine.weights.targets)
            for name, p in comp.policy.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p
                assert torch.equal(mirror[name], full.to(mirror[name].dtype)), name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_two_gpus_equal_one_gpu(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    mp.spawn(_run, args=(1, str(one), _port(), "none"), nprocs=1, join=True)
    mp.spawn(_run, args=(2, str(two), _port(), "fsdp"), nprocs=2, join=True)
    a = {r["step"]: r for r in read_jsonl(one / "run" / "metrics.jsonl")}
    b = {r["step"]: r for r in read_jsonl(two / "run" / "metrics.jsonl")}
    for step in (1, 2, 3):
        for key in ("reward", "num_tokens", "grad_norm", "entropy"):
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-3, abs_tol=1e-4), (step, key)

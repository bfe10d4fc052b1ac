"""Invariant: 2 data-parallel ranks (gloo, CPU) compute the same steps as 1 rank on the same global batch."""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.gloo_ranks import enter_rank, leave_rank
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.run.logging import read_jsonl
from cohort.trainer import train

COMPARED = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "num_tokens", "grad_norm",
            "entropy", "clip_ratio/region_mean", "completions/max_length", "completions/min_length")


def _run(rank: int, world: int, out: str, init_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    enter_rank()
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from pathlib import Path

        cfg = toy_config(Path(out), steps=2)
        cfg.advantage.scale_rewards = "batch"  # needs every rank's rewards: exercises the gather
        cfg.train.device = "cpu"
        comp = toy_components(cfg)
        train(cfg, comp)
        torch.save({n: p.detach() for n, p in comp.policy.named_parameters()}, f"{out}/weights-{rank}.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()
    leave_rank()


def test_two_ranks_equal_one_rank(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    mp.spawn(_run, args=(1, str(one), str(tmp_path / "init1")), nprocs=1, join=True)
    mp.spawn(_run, args=(2, str(two), str(tmp_path / "init2")), nprocs=2, join=True)
    a = {r["step"]: r for r in read_jsonl(one / "run" / "metrics.jsonl")}
    b = {r["step"]: r for r in read_jsonl(two / "run" / "metrics.jsonl")}
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        for key in COMPARED:
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-4, abs_tol=1e-6), (step, key, a[step][key],
                                                                                        b[step][key])
    w0, w1 = torch.load(two / "weights-0.pt"), torch.load(two / "weights-1.pt")
    assert all(torch.equal(w0[n], w1[n]) for n in w0)  # the ranks stay in lockstep


def _run_nan_on_one_rank(rank: int, world: int, out: str, init_file: str) -> None:
    """Rank 1's loss is NaN in step 2 (its gradients are not); the fused AdamW's device-side skip must skip that
    update on both ranks."""
    enter_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)

    class FusedAdamW(torch.optim.AdamW):  # the GPU's optimiser, whose skip is decided without a host read
        def __init__(self, params, **kwargs):
            super().__init__(params, **{**kwargs, "fused": True})

    torch.optim.AdamW = FusedAdamW  # this spawned process only
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from pathlib import Path

        from cohort.update import fused_adam_of

        cfg = toy_config(Path(out) / f"rank{rank}", steps=3)
        cfg.train.device = "cpu"
        comp = toy_components(cfg)
        assert fused_adam_of(comp.optimizer) is not None
        real, calls = comp.loss_fn, []

        def loss_fn(inputs):
            result = real(inputs)
            calls.append(1)
            if rank == 1 and len(calls) == 2:  # one micro-batch per update: step 2's only one
                # a NaN loss with finite gradients: only rank 1 sees it, so the ranks must agree through
                # distributed.any_rank_tensor (a NaN gradient would reach rank 0 in the gradient sum anyway)
                result.loss = result.loss + torch.tensor(float("nan"))
            return result

        comp = dataclasses.replace(comp, loss_fn=loss_fn)
        result = train(cfg, comp)
        torch.save({"skipped": [m["skipped_updates"] for m in result.history],
                    "weights": {n: p.detach() for n, p in comp.policy.named_parameters()}},
                   f"{out}/result-{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_rank()


def test_a_nan_on_one_rank_skips_the_fused_update_on_every_rank(tmp_path):
    mp.spawn(_run_nan_on_one_rank, args=(2, str(tmp_path), str(tmp_path / "init")), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "result-0.pt"), torch.load(tmp_path / "result-1.pt")
    assert r0["skipped"] == r1["skipped"] == [0.0, 1.0, 0.0]
    assert all(torch.equal(r0["weights"][n], r1["weights"][n]) for n in r0["weights"])  # still in lockstep

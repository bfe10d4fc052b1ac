"""Resume of a sharded (train.sharding=fsdp) run through the trainer, on as many ranks as saved it or fewer.

One module fixture trains the toy task (tests/integration/test_trainer_learns.py) on 2 gloo CPU ranks with
FSDP2: run A for 4 steps straight; run B for 2 steps (train.max_steps=2, so a checkpoint at step 2). Copies
of B are then resumed with run.resume=true and train.max_steps=4, on 1 rank (still train.sharding=fsdp, a
world of one) and on 2 fresh ranks. The rounds use 2 mini-batches and a small token budget, so every rank
runs several micro-batches; prompts, completions and the LR (constant) do not depend on the rank count or on
max_steps, so the resumed steps 3 and 4 must be run A's steps 3 and 4.

Tolerances (float32 on the CPU):
- 2 -> 2 ranks: the same reductions in the same order from the exact fp32 state, so every non-time metric
  and every weight is asserted bit-equal (observed: bit-equal).
- 2 -> 1 rank: one rank sums gradients, losses and metrics in another order than two ranks' reduce-scatter
  and all-reduce (~1e-7 relative per sum), and Adam at lr 1e-2 (steps ~ lr * m / sqrt(v)) can magnify that
  noise in the weights. Bounds: METRIC_RTOL = 1e-5 on reward, reward_std, grad_norm, num_tokens, entropy,
  clip ratio and mean length (observed <= 9e-7, grad_norm); WEIGHT_ATOL = 1e-4 on the final weights
  (|w| <= ~1; observed 2.4e-7). A lost or misread Adam state moves weights by ~lr = 1e-2, far above both.
  Not compared 2 -> 1: statistics each rank takes over its own completions and the ranks then average or
  min-reduce (rewards/<fn>/std, completions/*_terminated_length), which depend on the rank count by design.
The Hugging Face folder rank 0 exports is compared bit for bit with the gathered final parameters.

Workers write what they observe to files and the test process compares, so a failure reads as an assertion.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.gloo_ranks import enter_rank, leave_rank

from cohort.run.logging import read_jsonl

STRAIGHT, STOP = 4, 2
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-7
WEIGHT_ATOL = 1e-4
COMPARED = ("reward", "reward_std", "grad_norm", "num_tokens", "entropy", "clip_ratio/region_mean",
            "completions/mean_length")
VOLATILE = ("time", "step_time", "train_time", "time/")


def _full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered: collective, call on every rank), by canonical name."""
    from torch.distributed.tensor import DTensor

    from cohort.checkpointing.dcp import canonical_name

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[canonical_name(name)] = t.detach().clone()
    return out


def _worker(rank: int, world: int, out: str, init_file: str, steps: int, resume: bool) -> None:
    """The trainer with train.sharding=fsdp on `world` ranks; rank 0 saves the gathered final weights."""
    enter_rank()
    from tests.integration.test_trainer_learns import toy_components, toy_config

    from cohort.trainer import train

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if world > 1:  # one rank: the trainer makes its own world of one for FSDP
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = toy_config(Path(out), steps=steps)
        cfg.train.device, cfg.train.sharding, cfg.run.resume = "cpu", "fsdp", resume
        cfg.train.mini_batches = 2  # mini-batch k takes prompts k % M: the same split on 1 rank as on 2
        cfg.train.token_budget = 48  # several micro-batches per rank
        cfg.advantage.scale_rewards = "batch"  # needs every rank's rewards
        comp = toy_components(cfg)
        train(cfg, comp)
        params = _full_params(comp.policy)
        if rank == 0:
            torch.save(params, Path(out) / f"weights-{world}.pt")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_rank()


def _spawn(world: int, out: Path, steps: int, resume: bool = False) -> None:
    """`world` fresh processes, forked from a forkserver that imported torch and transformers once (spawning
    each would spend seconds importing them on 2 cores); the forkserver never ran torch ops."""
    multiprocessing.set_forkserver_preload(["torch", "transformers.models.llama.modeling_llama", "cohort.trainer",
                                            "tests.integration.test_trainer_learns", __name__])
    init = out / f"init-{world}-{steps}-{int(resume)}"
    init.unlink(missing_ok=True)
    mp.start_processes(_worker, args=(world, str(out), str(init), steps, resume), nprocs=world, join=True,
                       start_method="forkserver")


def _rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(out / "run" / "metrics.jsonl")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """straight: 2 ranks, 4 steps. stopped: 2 ranks, 2 steps. one/two: copies of stopped resumed to 4 steps."""
    root = tmp_path_factory.mktemp("fsdp-resume")
    dirs = {name: root / name for name in ("straight", "stopped", "one", "two")}
    for d in dirs.values():
        d.mkdir()
    _spawn(2, dirs["straight"], STRAIGHT)
    _spawn(2, dirs["stopped"], STOP)
    assert (dirs["stopped"] / "run" / "checkpoints" / f"step-{STOP:06d}" / "dcp" / ".metadata").is_file()
    for name, world in (("one", 1), ("two", 2)):
        shutil.copytree(dirs["stopped"] / "run", dirs[name] / "run")
        _spawn(world, dirs[name], STRAIGHT, resume=True)
    return dirs


def _assert_resumed(runs: dict[str, Path], name: str, world: int, keys, rtol: float, atol: float,
                    weight_atol: float) -> None:
    a, b = _rows(runs["straight"]), _rows(runs[name])
    assert sorted(a) == sorted(b) == list(range(1, STRAIGHT + 1))
    for step in range(STOP + 1, STRAIGHT + 1):
        for key in keys(a[step]):
            assert key in b[step], (step, key)
            assert math.isclose(a[step][key], b[step][key], rel_tol=rtol, abs_tol=atol), (
                step, key, a[step][key], b[step][key])
    wa = torch.load(runs["straight"] / "weights-2.pt")
    wb = torch.load(runs[name] / f"weights-{world}.pt")
    assert sorted(wa) == sorted(wb)
    worst = max((wa[n] - wb[n]).abs().max().item() for n in wa)
    assert worst <= weight_atol, worst


def test_resume_two_rank_checkpoint_on_one_rank(runs):
    """2 FSDP ranks, stop at step 2, resume on 1 rank (FSDP world of one) == 4 steps on 2 ranks."""
    _assert_resumed(runs, "one", 1, lambda row: COMPARED, METRIC_RTOL, METRIC_ATOL, WEIGHT_ATOL)


def test_resume_two_rank_checkpoint_on_two_ranks(runs):
    """2 FSDP ranks, stop at step 2, resume on 2 fresh ranks == 4 steps straight, bit for bit: every non-time
    metric and every weight."""
    def every_metric(row):
        return [k for k, v in row.items() if isinstance(v, float) and not k.startswith(VOLATILE)]

    _assert_resumed(runs, "two", 2, every_metric, 0.0, 0.0, 0.0)


def test_sharded_checkpoint_folder_loads_with_from_pretrained(runs):
    """The step-4 folder of the 2-rank run is a Hugging Face model whose weights are the gathered ones."""
    from transformers import AutoModelForCausalLM

    from cohort.checkpointing import latest_checkpoint

    folder = latest_checkpoint(runs["straight"] / "run")
    assert folder is not None and folder.name == f"step-{STRAIGHT:06d}"
    model = AutoModelForCausalLM.from_pretrained(folder)
    gathered = torch.load(runs["straight"] / "weights-2.pt")
    loaded = dict(model.named_parameters(remove_duplicate=False))
    assert set(gathered) <= set(loaded), sorted(set(gathered) - set(loaded))
    for name, want in gathered.items():
        got = loaded[name].detach()
        assert got.dtype == want.dtype == torch.float32, (name, got.dtype, want.dtype)  # CPU: fp32 as saved
        assert torch.equal(got, want), (name, (got - want).abs().max().item())
    # the tied LM head is written once and tied again on load
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

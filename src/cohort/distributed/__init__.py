"""Data parallelism over torch.distributed, started by torchrun: `torchrun --nproc-per-node 2 -m cohort.cli train ...`.

Each rank owns one rollout engine and a contiguous slice of every step's prompts (the sampler is seeded
the same everywhere, so all ranks agree on the step's prompts). Rewards are gathered so advantages see every
group (exact for group and batch scaling), the loss is normalised by token and sequence counts summed over
ranks, and gradients are summed (not averaged) across ranks before clipping, so N ranks compute exactly the
update one rank would compute on the whole step. Only rank 0 writes the run directory: logs, checkpoints,
evaluation. With one process every function here is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cohort.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_from_env() -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE > 1); NCCL on GPUs, gloo on CPUs."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return current()


def current() -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size())
    return DistInfo()


def local_device(name: str) -> str:
    """`auto` on a multi-GPU rank means this rank's GPU."""
    if name == "auto" and current().enabled and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return name


def check_layout(prompts_per_step: int, mini_batches: int, dynamic_sampling: bool) -> None:
    info = current()
    if not info.enabled:
        return
    if prompts_per_step % info.world_size or (prompts_per_step // info.world_size) % mini_batches:
        raise ConfigError(f"train.prompts_per_step={prompts_per_step} must split into {info.world_size} ranks x "
                          f"train.mini_batches={mini_batches} whole groups; choose a multiple of "
                          f"{info.world_size * mini_batches}.")
    if dynamic_sampling:
        raise ConfigError("reward.dynamic_sampling=true is not supported with several ranks yet; set it to false "
                          "or run on one process.")


def rank_slice(items: list, info: DistInfo | None = None) -> list:
    info = info or current()
    per = len(items) // info.world_size
    return items[info.rank * per:(info.rank + 1) * per]


def all_sum(value: float) -> float:
    if not current().enabled:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return float(t.item())


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank along dim 0, in rank order."""
    if not current().enabled:
        return t
    local = t.to(_comm_device())
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(t.device)


def sum_gradients(params) -> None:
    """Sum every gradient over ranks, through one flat buffer (one collective, not one per tensor)."""
    if not current().enabled:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def reduce_metrics(metrics: dict[str, float], *, summed: tuple[str, ...] = ()) -> dict[str, float]:
    """Per-rank step metrics -> the step's: min/max names by min/max, `summed` names by sum, others by mean."""
    info = current()
    if not info.enabled:
        return metrics
    names = sorted(k for k, v in metrics.items() if isinstance(v, int | float))
    out = dict(metrics)
    for op, pick in ((dist.ReduceOp.MIN, lambda k: k.endswith("min") or "/min_" in k),
                     (dist.ReduceOp.MAX, lambda k: k.endswith("max") or "/max_" in k or k.startswith("time")
                                          or k == "step_time")):
        keys = [k for k in names if pick(k)]
        if keys:
            t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=_comm_device())
            dist.all_reduce(t, op=op)
            out.update(zip(keys, t.tolist()))
            names = [k for k in names if k not in keys]
    if names:
        t = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64, device=_comm_device())
        dist.all_reduce(t)
        scale = {k: 1.0 if k in summed else 1.0 / info.world_size for k in names}
        out.update({k: v * scale[k] for k, v in zip(names, t.tolist())})
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one (ranks must agree on when to stop)."""
    if not current().enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if current().enabled:
        dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

"""Data parallelism over torch.distributed, started by torchrun: `torchrun --nproc-per-node 2 -m cohort.cli train ...`.

Each rank owns one rollout engine and a contiguous slice of every step's prompts (the sampler is seeded
the same everywhere, so all ranks agree on the step's prompts). Rewards are gathered so advantages see every
group (exact for group and batch scaling), the loss is normalised by token and sequence counts summed over
ranks, and gradients are summed (not averaged) across ranks before clipping, so N ranks compute exactly the
update one rank would compute on the whole step. Only rank 0 writes the run directory: logs, checkpoints,
evaluation. With one process every function here is a no-op.

Failures end the whole launch: every collective has a timeout (`train.dist_timeout_s`, given to
`init_from_env`), and the trainer wraps each stage in `phase(name, step)`, which prints
`cohort: rank R of W failed during <phase> at step S: <ExcType>: <msg>` before re-raising. The rank exits
non-zero and torchrun stops the others; a rank left waiting in a collective on a peer that is stuck (not
dead) raises when the timeout expires and names its own phase the same way.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

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


def init_from_env(timeout_s: float | None = None) -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE > 1); NCCL on GPUs, gloo on CPUs.

    timeout_s (`train.dist_timeout_s`) bounds every collective: a rank waiting longer for a peer raises
    (gloo) or is torn down by NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, set here unless the
    environment already says otherwise) instead of hanging the launch. None: torch's default."""
    world = world_size_from_env()
    if world > 1 and not dist.is_initialized():
        local_rank = _check_launch(world)
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)  # None: torch's default
        if torch.cuda.is_available():
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    return current()


_LAUNCH_FIX = "launch with torchrun (torchrun --nproc-per-node N -m cohort.cli train ...), or unset it for one process"


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"the environment variable {name}={raw[:100]!r} is not a whole number; "
                          f"{_LAUNCH_FIX}") from None
    if value < minimum:
        raise ConfigError(f"the environment variable {name}={value} is not valid (at least {minimum}); {_LAUNCH_FIX}")
    return value


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset); a ConfigError when it is not a positive whole number."""
    return _env_int("WORLD_SIZE", 1, 1)


def _check_launch(world: int) -> int:
    """With WORLD_SIZE > 1: RANK and LOCAL_RANK are numbers in range and torchrun's rendezvous (MASTER_ADDR,
    MASTER_PORT) is set, else a ConfigError, not torch's traceback. Returns LOCAL_RANK."""
    rank, local_rank = _env_int("RANK", 0, 0), _env_int("LOCAL_RANK", 0, 0)
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(f"the environment variable WORLD_SIZE={world} asks for {world} processes, but "
                          f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so they cannot "
                          f"meet: launch with torchrun --nproc-per-node {world} -m cohort.cli train ... (it sets "
                          "them), or unset WORLD_SIZE for one process")
    _env_int("MASTER_PORT", 0, 1)
    if rank >= world:
        raise ConfigError(f"the environment variable RANK={rank} is not below WORLD_SIZE={world}; {_LAUNCH_FIX}")
    return local_rank


@contextlib.contextmanager
def phase(name: str, step: int | None = None) -> Iterator[None]:
    """Name the stage a rank is in, so a failure of one rank of a launch says where it happened.

    An exception inside prints one line to stderr, `cohort: rank R of W failed during <name> at step S:
    <ExcType>: <msg>`, and is re-raised unchanged (the rank exits non-zero, torchrun stops the others).
    Printed once, by the innermost phase, and only with several ranks (one process reports errors as
    before). A collective that times out on a rank waiting for a stuck peer is reported the same way."""
    try:
        yield
    except Exception as exc:
        info = current()
        if info.enabled and not getattr(exc, "_cohort_phase_reported", False):
            at = "" if step is None else f" at step {step}"
            msg = " ".join(str(exc).split())
            if len(msg) > 500:
                msg = msg[:497] + "..."
            print(f"cohort: rank {info.rank} of {info.world_size} failed during {name}{at}: "
                  f"{type(exc).__name__}: {msg}", file=sys.stderr, flush=True)
            with contextlib.suppress(AttributeError, TypeError):
                exc._cohort_phase_reported = True  # type: ignore[attr-defined]
        raise


def current() -> DistInfo:
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size())
    return DistInfo()


def local_device(name: str) -> str:
    """`auto` on a multi-GPU rank means this rank's GPU."""
    if name == "auto" and current().enabled and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return name


def check_layout(prompts_per_step: int, mini_batches: int) -> None:
    info = current()
    if not info.enabled:
        return
    if prompts_per_step % info.world_size or (prompts_per_step // info.world_size) % mini_batches:
        raise ConfigError(f"train.prompts_per_step={prompts_per_step} must split into {info.world_size} ranks x "
                          f"train.mini_batches={mini_batches} whole groups; choose a multiple of "
                          f"{info.world_size * mini_batches}.")


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


def thread_gatherer(timeout_s: float | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """all_gather_rows over a gloo group of its own, for a thread that runs beside the training loop (the
    rollout pipeline of train.max_staleness). Collectives on one group must come in the same order on every
    rank; two threads sharing the default group could not promise that, one thread per group does. Every rank
    must call this at the same point (it makes a group). The tensors travel through the CPU (rewards: small)."""
    info = current()
    if not info.enabled:
        return lambda t: t
    group = dist.new_group(backend="gloo", timeout=None if timeout_s is None else timedelta(seconds=timeout_s))

    def gather(t: torch.Tensor) -> torch.Tensor:
        local = t.detach().cpu().contiguous()
        parts = [torch.empty_like(local) for _ in range(info.world_size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts).to(t.device)

    return gather


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


def all_max(value: int) -> int:
    """The largest value over ranks (e.g. the micro-batch count every sharded rank must run)."""
    if not current().enabled:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank_tensor(flag: torch.Tensor) -> torch.Tensor:
    """A float flag tensor (1.0 = true), maxed over ranks on the device: no host read (see any_rank)."""
    if not current().enabled:
        return flag
    t = flag.reshape(1).to(_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.reshape(()).to(flag.device)


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one (ranks must agree on when to stop)."""
    if not current().enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def shutdown() -> None:
    """After training: wait until every rank is done (no collective still in flight), then end the group, so
    no rank tears down communication threads under a peer that still uses them."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def barrier() -> None:
    if current().enabled:
        dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

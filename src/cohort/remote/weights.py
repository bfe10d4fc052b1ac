"""Weights from the trainer to a served engine: the manifest, the bucket plan and the process group.

A push is: the trainer announces a manifest (every tensor's name, shape and dtype, in order) and a bucket
plan; the server checks the manifest against its own model and refuses any mismatch; then each bucket travels
as ONE flat buffer through a torch.distributed broadcast (trainer rank 0 -> server rank 1), so a 1.5B model
is a handful of collectives, not one per tensor. The server unpacks the buckets into a staging copy and
switches versions only when every bucket has arrived (see server.py).

The group is made without `init_process_group` (the trainer may already have its default group for data
parallelism): a TCPStore the server hosts on a port it announces, and a ProcessGroupGloo (CPU) or
ProcessGroupNCCL (GPU) built on it directly, with a timeout on every collective. The store listens on the
server's own host only (the address `cohort serve --host` binds, never every interface), and the group's keys
live under a prefix drawn for each group, which the server tells only an authenticated trainer: a process that
finds the port cannot take the trainer's place in the group.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cohort.errors import CohortError
from cohort.remote.lora_merge import is_peft_model, merged_tensors

DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_PREFIX = "cohort-weights"  # the group's keys in the store; a server adds a secret part per group
_EVERY_INTERFACE = ("", "0.0.0.0", "::")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                      torch.int64, torch.int32, torch.int8, torch.uint8,
                                                      torch.bool)}


class WeightMismatchError(CohortError):
    """A push whose names, shapes or dtypes do not match the served model: refused before any byte moves."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16", "float32", ...

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=dtype_of(self.dtype)).element_size()

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, item: Sequence) -> TensorSpec:
        name, shape, dtype = item
        return cls(str(name), tuple(int(s) for s in shape), str(dtype))


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise WeightMismatchError(f"dtype {name!r} cannot be pushed; known: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


def model_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a push carries: every parameter once (tied weights once, under their first name), in module
    order, then every floating-point buffer (`buffer_names`).

    Buffers travel too because they are not always what the config gives: `model.to(torch.bfloat16)` also
    casts HF's RoPE frequencies (`rotary_emb.inv_freq`, computed in float32 and kept so by from_pretrained),
    and the engine's RoPE tables come from them. A server that kept its own float32 frequencies rotated
    differently from the trainer's engine and forward (measured: the greedy tokens of a toy model after a
    perturbation differed in 11 of 40 trials); with them pushed, the server computes the trainer's model.
    A peft LoRA policy pushes the plain model's names, adapted weights merged when packed (lora_merge.py)."""
    if is_peft_model(model):
        return merged_tensors(model)  # type: ignore[return-value]  # MergedWeight: shape, dtype, detach()
    named = [(n, p) for n, p in model.named_parameters()]
    return named + [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]


def buffer_names(model: torch.nn.Module) -> set[str]:
    """The buffers `model_tensors` lists: a push may carry them in another floating dtype (a model cast with
    .to(dtype) casts them too); the server copies them into its own with a cast."""
    return {n for n, b in model.named_buffers() if b.is_floating_point()}


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of `specs` grouped into buckets: consecutive tensors of one dtype, at most `bucket_bytes` each
    (a tensor larger than that is a bucket of its own). Both sides unpack by this plan.

    >>> s = [TensorSpec("a", (2,), "float32"), TensorSpec("b", (2,), "float32"), TensorSpec("c", (4,), "float32")]
    >>> plan_buckets(s, 16)
    [[0, 1], [2]]
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, spec in enumerate(specs):
        if buckets and spec.dtype == dtype and size + spec.nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += spec.nbytes
        else:
            buckets.append([i])
            size, dtype = spec.nbytes, spec.dtype
    return buckets


def check_manifest(pushed: Sequence[TensorSpec], served: Sequence[TensorSpec], castable: Collection[str] = ()) -> None:
    """Raise WeightMismatchError listing what differs (names missing or unknown, shapes, dtypes). Tensors named
    in `castable` (the served model's floating buffers) may differ in floating dtype: they are cast on copy."""
    mine = {s.name: s for s in served}
    theirs = {s.name: s for s in pushed}
    problems = []
    unknown = [n for n in theirs if n not in mine]
    missing = [n for n in mine if n not in theirs]
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) the served model does not have (e.g. {unknown[:3]})")
    if missing:
        problems.append(f"{len(missing)} of the served model's tensor(s) missing from the push (e.g. {missing[:3]})")
    for name, spec in theirs.items():
        own = mine.get(name)
        if own is not None and own.shape != spec.shape:
            problems.append(f"{name!r} has shape {list(spec.shape)} in the push but {list(own.shape)} on the server")
        elif own is not None and own.dtype != spec.dtype and not (name in castable and _floating(own, spec)):
            problems.append(f"{name!r} is {spec.dtype} in the push but {own.dtype} on the server")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise WeightMismatchError(f"weight push refused, it does not match the served model: {shown}. Serve the "
                                  "same architecture and dtype as the trainer's policy (cohort serve MODEL --dtype)")


def _floating(*specs: TensorSpec) -> bool:
    return all(dtype_of(s.dtype).is_floating_point for s in specs)


def check_plan(plan: Sequence[Sequence[int]], count: int) -> None:
    flat = [i for bucket in plan for i in bucket]
    if flat != list(range(count)):
        raise WeightMismatchError(f"weight push refused: the bucket plan must list tensors 0..{count - 1} once, "
                                  "in order")


# ---------------------------------------------------------------------------------------------------------
# The process group


def gpu_uuid(device: torch.device) -> str | None:
    """The physical GPU behind `device` (None off CUDA): the trainer and the server compare theirs, since NCCL
    cannot hold two ranks of one group on the same GPU ("Duplicate GPU detected") and CUDA_VISIBLE_DEVICES
    numbers the same card differently in each process."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def make_group(host: str, port: int, rank: int, *, backend: str, timeout_s: float, store=None,
               prefix: str = DEFAULT_PREFIX, bind_host: str | None = None):
    """A two-member group (rank 0: trainer, rank 1: server) over the TCPStore at host:port (the server passes its
    own `store`, the master), its keys under `prefix`. Every collective on it fails after `timeout_s` instead
    of hanging. `bind_host`: gloo's own sockets listen on that address (the server's host), not on whatever
    the machine's name resolves to."""
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, 2, False, timeout)
    prefixed = dist.PrefixStore(prefix, store)
    if backend == "gloo" and bind_host not in (None, *_EVERY_INTERFACE):
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, as NCCL's _timeout
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        return dist.ProcessGroupGloo(prefixed, rank, 2, options)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")


def host_store(host: str, timeout_s: float):
    """The server's end: a TCPStore master on a free port of `host` (read it from `.port`), listening on that
    address only. (TCPStore binds every interface when it opens the port itself, so the socket is bound here
    and handed over.)"""
    family, _, _, _, address = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(address)
        sock.listen(64)
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store owns the listening socket from here
    try:
        return dist.TCPStore(host, port, 2, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def send_buckets(group, tensors: Sequence[torch.Tensor], plan: Sequence[Sequence[int]], device: torch.device) -> None:
    """Trainer side: one broadcast per bucket, from a flat buffer packed on `device`."""
    for bucket in plan:
        parts = [tensors[i].detach().reshape(-1) for i in bucket]
        flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device).contiguous()
        group.broadcast(flat, 0).wait()
        if device.type == "cuda":  # NCCL's wait only orders streams: keep `flat` alive until it is sent
            torch.cuda.current_stream(device).synchronize()


def receive_buckets(group, specs: Sequence[TensorSpec], plan: Sequence[Sequence[int]],
                    device: torch.device, after_bucket: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Server side: receive every bucket into its own flat buffer; returns name -> view into those buffers.
    `after_bucket(k)` runs once bucket k has arrived (the tests' fault hook)."""
    staged: dict[str, torch.Tensor] = {}
    for k, bucket in enumerate(plan):
        flat = torch.empty(sum(specs[i].numel for i in bucket), dtype=dtype_of(specs[bucket[0]].dtype), device=device)
        group.broadcast(flat, 0).wait()
        offset = 0
        for i in bucket:
            spec = specs[i]
            staged[spec.name] = flat[offset:offset + spec.numel].view(spec.shape)
            offset += spec.numel
        if after_bucket is not None:
            after_bucket(k)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return staged

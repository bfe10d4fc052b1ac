"""FSDP2 sharding of the policy (`train.sharding: fsdp`) and the engine's gathered copy of its weights.

Layout (torchtitan's): one `fully_shard` unit per decoder layer plus the root (embeddings, final norm, LM
head). Parameters that train are upcast to float32 before sharding, so each rank keeps 1/N of the float32
master weights, gradients and Adam moments (the sharded form of `train.master_weights`); compute runs in
bfloat16 (`MixedPrecisionPolicy(param_dtype=bf16)`) and gradients are reduce-scattered in float32. With
`train.master_weights=false` the parameters stay in their own dtype (bf16 moments, as TRL). On the CPU the
model is float32 and no casting happens.

The rollout engine needs whole weights. Before sharding, `mirror_for_engine` builds a second module that
keeps the ORIGINAL parameter storage (sharding gives the policy new tensors, so no extra memory is used);
after every optimizer step `WeightGather.gather` all-gathers each unit's shards in bf16 (one collective per
unit, not one per tensor) and copies them into the mirror. The mirror's tensors never move, so the engine's
CUDA graphs stay valid across refreshes. Under LoRA only the trainable (adapter) tensors change, so only
those are gathered.

The trainer calls the decoder body and the LM-head weight directly (packed forward, chunked logprobs), not
the root module's forward, so the packed pass is registered as an FSDP forward method on the root: calling
it unshards the root's parameters and hooks the backward exactly as a root forward would.
"""

from __future__ import annotations

import copy
import time
import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from cohort.errors import ConfigError
from cohort.forward.packing import packed_pass

try:  # FSDP2 (torch >= 2.6); without it train.sharding=fsdp is refused, naming the torch it needs
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )
except ImportError:  # pragma: no cover - CI and the GPU machines have it
    FSDPModule = MixedPrecisionPolicy = fully_shard = register_fsdp_forward_method = None  # type: ignore[assignment,misc]

PACKED_METHOD = "cohort_packed_pass"


def fsdp_available() -> tuple[bool, str]:
    if fully_shard is None:
        return False, f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard (FSDP2); use torch >= 2.6"
    return True, "ok"


def ensure_process_group(device: torch.device) -> None:
    """FSDP needs a process group even on one process: make a world of one (no torchrun needed)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a *ForCausalLM, also inside a PEFT wrapper."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    body = getattr(base, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ConfigError(f"train.sharding=fsdp: {type(base).__name__} has no .model.layers to shard per block; "
                          "use train.sharding=none for this architecture.")
    return list(layers)


# ---------------------------------------------------------------------------------------------------------
# The engine's copy


def mirror_for_engine(model: nn.Module) -> nn.Module:
    """A structural copy of `model` whose parameters are new Parameter objects over the SAME storage.

    Call before sharding: sharding (and the fp32 upcast before it) replaces the policy's tensors, and the
    mirror keeps the originals as the engine's weights. Buffers (RoPE tables) are copied; they are small.
    """
    memo = {}
    for p in model.parameters():
        if id(p) not in memo:  # tied weights map to one new Parameter, as in the original
            memo[id(p)] = nn.Parameter(p.detach(), requires_grad=False)
    mirror = copy.deepcopy(model, memo)
    mirror.eval()
    return mirror


class WeightGather:
    """Refresh the engine's mirror from the sharded policy after each optimizer step (all ranks at once)."""

    def __init__(self, policy: nn.Module, mirror: nn.Module, units: list[nn.Module]):
        self.policy, self.units = policy, units
        self.targets = dict(mirror.named_parameters(remove_duplicate=False))
        names = {id(m): n for n, m in policy.named_modules()}
        self.prefix = {id(u): (names[id(u)] + "." if names[id(u)] else "") for u in units}
        self.adapters_only = any(not p.requires_grad for p in policy.parameters())
        self.seconds = 0.0

    @torch.no_grad()
    def gather(self) -> float:
        """Copy the current weights into the mirror; returns the seconds it took (device-synchronised)."""
        start = time.perf_counter()
        if self.adapters_only:
            self._gather_trainable()
        else:
            for unit in self.units:
                self._gather_unit(unit)
        device = next(iter(self.targets.values())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.seconds = time.perf_counter() - start
        return self.seconds

    def _gather_unit(self, unit: nn.Module) -> None:
        _sharded(unit).unshard()  # one all-gather of the unit's shards, in the compute dtype
        try:
            for name, p in unit.named_parameters(remove_duplicate=False):
                if isinstance(p, DTensor):  # a child unit's parameter: gathered with that unit
                    continue
                self.targets[self.prefix[id(unit)] + name].copy_(p)
        finally:
            _sharded(unit).reshard()

    def _gather_trainable(self) -> None:
        for name, p in self.policy.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                full = p.full_tensor() if isinstance(p, DTensor) else p
                self.targets[name].copy_(full)


class GatheredEngine:
    """The rollout engine over the mirror; `sync_weights` first gathers the shards into it."""

    def __init__(self, engine, gather: WeightGather):
        self.engine, self.weights = engine, gather

    def sync_weights(self) -> None:
        self.weights.gather()
        self.engine.sync_weights()

    def __getattr__(self, name):
        return getattr(self.engine, name)


# ---------------------------------------------------------------------------------------------------------
# Sharding


def _upcast_trainable(module: nn.Module, recurse: bool) -> None:
    for p in module.parameters(recurse=recurse):
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def _sharded(unit: nn.Module) -> FSDPModule:
    """`unit` as the FSDPModule fully_shard made of it (fully_shard swaps the module's class at run time)."""
    if not isinstance(unit, FSDPModule):
        raise TypeError(f"{type(unit).__name__} is not sharded: call shard_model first")
    return unit


def shard_model(model: nn.Module, *, device: torch.device, master_weights: bool, trainable: bool = True,
                reshard_after_forward: bool = True) -> list[nn.Module]:
    """fully_shard every decoder layer, then the root; returns the units (layers first, root last).

    Gradients are summed over ranks (divide factor 1): the loss is already normalised by the token and
    sequence counts of the whole step over all ranks, as in the unsharded data-parallel path.
    """
    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
    compute = next(model.parameters()).dtype
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    units = []
    for layer in decoder_layers(model):
        if trainable and master_weights and low:
            _upcast_trainable(layer, recurse=True)  # one layer at a time: the fp32 copy is transient
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        units.append(layer)
    if trainable and master_weights and low:
        _upcast_trainable(model, recurse=True)  # what is left: embeddings, final norm, LM head
    # the root's parameters are needed again right after the body (LM head): keep them gathered
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    units.append(model)
    for unit in units:
        sharded = _sharded(unit)
        sharded.set_gradient_divide_factor(1.0)
        if hasattr(sharded, "set_force_sum_reduction_for_comms"):  # plain SUM: gloo has no PREMUL_SUM
            sharded.set_force_sum_reduction_for_comms(True)
    _register_packed_pass(model)
    return units


def _register_packed_pass(model: nn.Module) -> None:
    setattr(model, PACKED_METHOD, types.MethodType(packed_pass, model))
    register_fsdp_forward_method(model, PACKED_METHOD)


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global norm of sharded (DTensor) or plain gradients; returns the norm before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(norm, DTensor):  # partial sums of squares over ranks -> the global norm
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)

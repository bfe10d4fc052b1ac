"""Optimiser and learning-rate schedule.

Precision policy (documented choice): on the GPU the policy's parameters live in bfloat16, so that the
rollout engine and the training forward both read half-size weights in place; the optimiser keeps float32
master weights and float32 Adam moments. A pure-bf16 AdamW would silently drop updates: with the usual RL
learning rates (1e-6) an update is ~1e-5 of a weight's magnitude, below bf16's 2^-8 resolution. On the CPU
(float32 parameters) the master copy is skipped and this is plain `torch.optim.AdamW`. `train.master_weights
=false` trades that safety for memory (TRL's precision): moments in bf16, no master copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_scheduler

from cohort.errors import ConfigError


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW over float32 master copies of low-precision parameters.

    step(): copy each parameter's gradient into its master (float32), run AdamW on the masters, and write
    the result back into the low-precision parameter. State dict round-trips the masters, so a resumed run
    continues from the exact float32 weights, not their bf16 rounding.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, **adamw_kwargs)
        # expose the inner param_groups so schedulers and logging see the real learning rate
        super().__init__(self.masters, dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        # multi-tensor copies (one launch per few dozen tensors, casting on the way) instead of one per parameter
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if p.grad is not None]
        for m in self.masters:
            m.grad = None
        if pairs:
            grads = [torch.empty_like(m) for _, m in pairs]
            torch._foreach_copy_(grads, [p.grad for p, _ in pairs])
            for (_, m), g in zip(pairs, grads):
                m.grad = g
        self.inner.step()
        torch._foreach_copy_(self.params, self.masters)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=True)

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self.masters]}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, state["masters"]):
                m.copy_(saved)
                p.copy_(saved)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in host memory between steps (ZeRO-Offload's memory saving, GPU compute).

    step() walks the parameters in buckets: copy the bucket's moments to the device, run the fused AdamW
    kernel there, copy them back, and let the device copies go. All copies are asynchronous and ordered on
    the current stream, so the step never waits for the host; device memory holds one bucket's moments at a
    time instead of all of them (for a 0.5B model in bf16: 0.5 GB transient instead of 1.8 GB resident),
    which leaves room for larger training micro-batches. Moments keep the parameters' dtype (as TRL's bf16
    runs); on a CPU-only machine this is plain AdamW in buckets.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, bucket_elements: int = 32 * 2**20,
                 **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in self.params:  # parameters in order; a bucket closes once it holds bucket_elements
            if size >= bucket_elements:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += p.numel()
        self.inner = [torch.optim.AdamW(b, **adamw_kwargs) for b in buckets if b]
        super().__init__(self.params, dict(self.inner[0].defaults))
        self.param_groups = [g for opt in self.inner for g in opt.param_groups]
        self._pin = torch.cuda.is_available()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
        host.copy_(t, non_blocking=True)
        return host

    @torch.no_grad()
    def step(self, closure=None):
        for opt in self.inner:
            live = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            if not live:
                continue
            host = {}
            for p in live:
                st = opt.state.get(p)
                if st:  # moments come in from the host; "step" stays where AdamW keeps it
                    for key in ("exp_avg", "exp_avg_sq"):
                        host[p, key] = st[key]
                        st[key] = st[key].to(p.device, non_blocking=True)
            opt.step()
            for p in live:
                st = opt.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    if (p, key) in host:  # back into the same host buffer (stream-ordered after its upload)
                        st[key] = host[p, key].copy_(st[key], non_blocking=True)
                    else:  # first step: AdamW made the moments on the device
                        st[key] = self._to_host(st[key])
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @property
    def state(self):
        merged = {}
        for opt in getattr(self, "inner", []):
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # torch.optim.Optimizer.__init__ assigns it; the inner optimizers own it
        pass

    def state_dict(self):
        if self._pin:  # the last step's moment copies into host memory are asynchronous: let them land first
            torch.cuda.synchronize()
        return {"buckets": [opt.state_dict() for opt in self.inner]}

    def load_state_dict(self, state):
        for opt, saved in zip(self.inner, state["buckets"], strict=True):
            opt.load_state_dict(saved)
            for st in opt.state.values():  # load_state_dict moves tensors to the parameters' device
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in st:
                        st[key] = self._to_host(st[key])
        self.param_groups = [g for opt in self.inner for g in opt.param_groups]


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    master_weights: bool = True, offload: bool = False, eps: float = 1e-8) -> torch.optim.Optimizer:
    """AdamW; with low-precision parameters, over fp32 masters unless master_weights=False (then the
    moments live in the parameters' dtype, as in TRL's bf16 runs: 6 bytes per parameter less).
    offload=True (needs master_weights=False or fp32 parameters) keeps the moments in host memory."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps}
    if params and params[0].is_cuda:
        kwargs["fused"] = True  # one kernel for all parameters instead of a loop of small ones
    low_precision = bool(params) and params[0].dtype in (torch.bfloat16, torch.float16)
    if offload:
        if master_weights and low_precision:
            raise ConfigError("train.optimizer_offload=true keeps Adam moments in the weights' dtype on the host; "
                              "set train.master_weights=false with it.")
        return HostOffloadAdamW(params, **kwargs)
    if master_weights and low_precision:
        return MasterWeightAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, *, kind: str, warmup_steps: float, total_steps: int,
                    kwargs: dict | None = None) -> LambdaLR:
    """cohort's own "constant" / "cosine": linear warmup ((u + 1) / warmup), then constant or cosine decay to
    zero over the remaining optimiser updates. Any other name is one of transformers' schedulers (TRL's
    lr_scheduler_type: linear, cosine_with_min_lr, constant_with_warmup, ...), built by its own
    `get_scheduler` with `kwargs` as its scheduler_specific_kwargs; "hf:<name>" asks transformers for a name
    cohort also defines ("hf:cosine", "hf:constant"). warmup_steps in (0, 1) is a fraction of total_steps,
    rounded up (transformers' rule)."""
    if 0 < warmup_steps < 1:
        warmup_steps = math.ceil(total_steps * warmup_steps)
    warmup_steps = int(warmup_steps)
    target = optimizer.inner if isinstance(optimizer, MasterWeightAdamW) else optimizer
    if kind not in ("constant", "cosine"):
        return get_scheduler(kind.removeprefix("hf:"), target, num_warmup_steps=warmup_steps,
                             num_training_steps=total_steps, scheduler_specific_kwargs=dict(kwargs or {}))

    def factor(update: int) -> float:
        if warmup_steps > 0 and update < warmup_steps:
            return (update + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (update - warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(target, factor)

"""Context parallelism (train.context_parallel = C): the groups, their collectives, and the update's share of data.

Groups. The W ranks form W / C context-parallel groups of C consecutive ranks (ranks g C .. g C + C - 1); the
groups are data parallel to each other. Every rank still generates its own slice of each step's prompts (as in
data parallelism); the update first gathers the rollouts of its group (`ContextGroup.union`), so the C ranks of
a group train on the same rows, each micro-batch's packed row split over them (cohort.forward.context_rows,
cohort.forward.context_attention).

Exactness. Every rank of a group computes the whole row's logprobs (each rank its own tokens', summed over the
group by `reduce`, whose backward hands every rank the same gradient unchanged), so each rank evaluates the same
loss of the whole micro-batch: every normalisation (token counts, per-sequence sums and means, GSPO's sequence
ratio) is the single-rank one. Each rank's parameter gradient is its own tokens' share, the K/V gradients of
other ranks' queries coming back through the all-gather's reduce-scatter; gradients are then summed over all W
ranks, as in data parallelism (the bucketed reducer, or FSDP's reduce-scatter: FSDP shards over the whole
world, a 1-D mesh), which sums the C shares within a group and the groups' gradients across. The mini-batch's
token and sequence counts are summed over groups, counted once per group (by its first rank), and so are the
loss's metrics.

With C = 1 nothing here is used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cohort.algorithms.loss_io import metric_reduction
from cohort.errors import ConfigError
from cohort.forward.context_rows import pack_context_row
from cohort.forward.packing import PackedRow
from cohort.types import RolloutBatch

# torch 2.13 names the tensor collectives *_single; older releases only have *_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over a group (rank-major); backward: reduce-scatter (sum) of the gradient, in fp32
    for half-precision tensors, so each rank gets the gradient every rank's queries put on its keys."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, size: int):
        ctx.group, ctx.size = group, size
        local = local.contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _ALL_GATHER(out, local, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wide = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
        wide = wide.contiguous()
        out = wide.new_empty((wide.shape[0] // ctx.size, *wide.shape[1:]))
        _REDUCE_SCATTER(out, wide, group=ctx.group)
        return out.to(grad.dtype), None, None


class _SumDisjoint(torch.autograd.Function):
    """All-reduce (sum) of tensors that are zero outside the entries each rank owns. Every rank then computes the
    same loss from the same sum, so the gradient of each rank's own entries is the incoming gradient, unchanged
    (no collective in the backward: summing it would count the loss once per rank)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group):
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def context_groups(size: int) -> tuple[int, int, object]:
    """(this rank's index in its group, the group's index, the process group); every rank must call it at the
    same point (it makes the groups). A ConfigError when `size` does not divide the world."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size < 1 or world % size:
        raise ConfigError(f"train.context_parallel={size} is not valid: it must divide the number of ranks "
                          f"({world}); choose a divisor of {world}, or launch a multiple of {size} ranks")
    rank = dist.get_rank()
    if size == world:
        return rank, 0, dist.group.WORLD
    mine = None
    for g in range(world // size):  # every rank makes every group, in the same order (new_group's contract)
        group = dist.new_group(list(range(g * size, (g + 1) * size)))
        if g == rank // size:
            mine = group
    return rank % size, rank // size, mine


class ContextGroup:
    """This rank's context-parallel group: rows packed for it, the gathered batch, once-per-group counts."""

    def __init__(self, size: int):
        self.size = size
        self.rank, self.index, self.group = context_groups(size)

    @property
    def leader(self) -> bool:
        """The group's first rank: it alone counts the group's shared rows and metrics in world sums."""
        return self.rank == 0

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return _GatherTokens.apply(local, self.group, self.size)

    def reduce(self, local: torch.Tensor) -> torch.Tensor:
        return _SumDisjoint.apply(local, self.group)

    def pack_row(self, model, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> PackedRow:
        return pack_context_row(model, sequences, size=self.size, rank=self.rank, gather=self.gather,
                                reduce=self.reduce)

    def once(self, value: float) -> float:
        """`value` from the leader, 0 from the others: a world sum then counts the group's rows once."""
        return value if self.leader else 0.0

    def once_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The loss's partial metrics, summed ones counted once per group (min / max ones are the same on every
        rank of the group already)."""
        return {k: (v if self.leader or metric_reduction(k) != "sum" else 0.0) for k, v in metrics.items()}

    def union(self, batch: RolloutBatch) -> RolloutBatch:
        """The rollouts of every rank of the group, in rank order (a contiguous block of the step's prompts), with
        what the update reads of them."""
        mine = {"prompt_ids": batch.prompt_ids, "completion_ids": batch.completion_ids,
                "sampling_logprobs": batch.sampling_logprobs, "finish_reasons": batch.finish_reasons,
                "loss_mask_keep": batch.loss_mask_keep, "completion_masks": batch.completion_masks,
                "advantages": batch.advantages.detach().cpu(), "group_size": batch.group_size}
        parts: list[dict | None] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        got = [p for p in parts if p is not None]
        if len({p["group_size"] for p in got}) != 1:
            raise ValueError("train.context_parallel: the ranks of a group made rollouts with different group sizes")
        n = sum(len(p["completion_ids"]) for p in got)
        masks = [m for p in got for m in (p["completion_masks"] or [None] * len(p["completion_ids"]))]

        def joined(name: str) -> list:
            return [x for p in got for x in p[name]]

        return RolloutBatch(
            prompt_ids=joined("prompt_ids"), completion_ids=joined("completion_ids"),
            sampling_logprobs=joined("sampling_logprobs"), finish_reasons=joined("finish_reasons"),
            completions_text=[""] * n, prompts=joined("prompt_ids"), rewards_per_func=torch.zeros(n, 0),
            rewards=torch.zeros(n), advantages=torch.cat([p["advantages"] for p in got]),
            loss_mask_keep=joined("loss_mask_keep"), group_size=got[0]["group_size"],
            completion_masks=masks if any(m is not None for m in masks) else None)

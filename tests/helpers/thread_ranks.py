"""A context-parallel group simulated by threads of one process: each thread one rank, the group's collectives
(an all-gather whose backward reduce-scatters, and a sum whose backward is the identity, as
cohort.distributed.context_parallel has them) meeting at a barrier. It lets a test split a row over 3 or 4
ranks without processes, and run the flash path of one GPU as several ranks (forward only there: CUDA's
autograd runs every backward on one device thread, where the ranks would wait for each other forever).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadGroup:
    """`size` ranks, one per thread; `gather(rank)` / `reduce(rank)` are each rank's collectives."""

    def __init__(self, size: int, timeout_s: float = 120.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout_s)
        self.slots: list[Any] = [None] * size

    def _exchange(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's value, in rank order (each rank reads before any writes again)."""
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def gather(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        group = self

        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, local):
                return torch.cat(group._exchange(rank, local.detach().clone()))

            @staticmethod
            def backward(ctx, grad):
                parts = group._exchange(rank, grad.detach().clone())
                return sum(p.chunk(group.size)[rank] for p in parts)

        return Gather.apply

    def reduce(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        group = self

        class Reduce(torch.autograd.Function):
            @staticmethod
            def forward(ctx, local):
                return sum(group._exchange(rank, local.detach().clone()))

            @staticmethod
            def backward(ctx, grad):
                return grad

        return Reduce.apply


def run_ranks(size: int, work: Callable[[int], Any], timeout_s: float = 300.0) -> list[Any]:
    """work(rank) on `size` threads at once; each rank's result, or the test fails with the first error."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"ranks still running after {timeout_s} s"
    return results

"""Router replay (train.router_replay, "R3"): the training forward routes each token to the experts the engine chose.

A mixture-of-experts policy routes every token twice per step: in the rollout engine when it samples, and in the
training forward whose logprobs the loss differentiates. Small numeric differences between the two forwards (bf16
kernels, batch shapes, summation order) flip near-tied top-k choices, and a flipped choice sends the token through
other experts: the trained logprobs then come from a different sub-network than the one that sampled, the largest
part of an MoE model's train/inference mismatch. With router replay the engine records the top-k expert indices of
every token it ran at every sparse layer (cohort.engine.routing, `Completion.routed_experts`), and the training
forward takes those instead of its own top-k:

- the router still computes its logits and float32 softmax from the training weights; each token's combine weights
  are the softmax probabilities gathered at the replayed experts, renormalised to sum 1 when the config sets
  `norm_topk_prob`, so the router's weight keeps receiving gradients through the replayed experts' gates (as verl's
  and slime's R3 do). Replaying the choices the router makes itself changes nothing (same values, same gradients);
- a row without a record takes the router's own top-k: the engine never feeds a sequence's last token (nothing is
  sampled after it), and that position's output predicts no trained token;
- the router load-balancing loss (loss.router_aux_loss_coef) reads the router logits, as without replay.

`replay_rows` lays the recorded rows out as a packed row holds its tokens (`sources` / `positions`: whose token and
where, so the plain and the shared-prompt layouts of cohort.forward.packing both work; `row_replay` sends them with
the row). `replaying(model, replay)` replaces the forward of every sparse block's router for the duration of a
block; the update's `RouterReplayer` keeps the replacement for a mini-batch's micro-batches and switches the row
each takes, from its forward to its backward (activation checkpointing recomputes with the same experts). The
replacement runs outside torch.compile (a compiled decoder layer breaks its graph around the router), is built once
per router (a compiled layer's guards see the same function every micro-batch) and reads its indices from a slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def is_sparse_block(module: nn.Module) -> bool:
    """A routed-experts MLP block (Qwen3-MoE's: `experts` and a `gate` router). The engine's Qwen3-MoE forward uses
    the same test, so both sides list the same sparse layers in the same order."""
    return hasattr(module, "experts") and hasattr(module, "gate")


def routers(model: nn.Module) -> list[Any]:
    """The router of every sparse block, in layer order (the order of a record's second axis); duck-typed HF modules
    (`weight`, `top_k`, `norm_topk_prob`)."""
    blocks: list[Any] = [module for module in model.modules() if is_sparse_block(module)]
    return [block.gate for block in blocks]


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact integer type of recorded expert indices: one byte up to 256 experts."""
    return torch.uint8 if num_experts <= 256 else torch.int16


@dataclass
class RouterReplay:
    """The replayed routing of one packed row, on the model's device.

    experts: [T, sparse layers, k] expert indices of the row's tokens (a compact integer type).
    valid: [T] bool, False on the rows without a record (they take the router's own top-k)."""

    experts: torch.Tensor
    valid: torch.Tensor


def plain_sources(lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, position) of each token of the plain packed row [s0 s1 ...] of sequences of these lengths."""
    lengths_a = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths_a)[:-1]]).astype(np.int64)
    sources = np.repeat(np.arange(len(lengths_a), dtype=np.int64), lengths_a)
    return sources, np.arange(int(lengths_a.sum()), dtype=np.int64) - starts[sources]


def replay_rows(routes: Sequence[np.ndarray | None], sources: np.ndarray, positions: np.ndarray,
                lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """([T, S, k] experts, [T] valid) of a packed row whose token t is position positions[t] of sequence sources[t].

    routes[i]: sequence i's record, row p = position p ([n, S, k] with n >= lengths[i] - 1: every token the engine
    fed, the last one excepted); lengths[i]: its prompt + completion tokens."""
    records: list[np.ndarray] = []
    for i, (record, n) in enumerate(zip(routes, lengths, strict=True)):
        if record is None:
            raise ValueError(f"train.router_replay: sequence {i} of the micro-batch carries no recorded routing "
                             "(its completion came from an engine that does not record it)")
        shape = records[0].shape[1:] if records else record.shape[1:]
        if len(record) < n - 1 or record.shape[1:] != shape:
            raise ValueError(f"train.router_replay: sequence {i} has {n} tokens but its recorded routing has shape "
                             f"{tuple(record.shape)} (expected at least {n - 1} rows of {tuple(shape)})")
        records.append(record)
    counts = np.asarray([len(r) for r in records], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    flat = np.concatenate(records)
    valid = positions < counts[sources]
    out = np.zeros((len(sources), *flat.shape[1:]), dtype=flat.dtype)
    out[valid] = flat[(starts[sources] + positions)[valid]]
    return out, valid


def row_replay(routes: Sequence[np.ndarray | None] | None, sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
               where: tuple[np.ndarray, np.ndarray] | None, send: Callable[[np.ndarray], torch.Tensor]) -> RouterReplay | None:
    """The recorded routing of packed (prompt, completion) pairs in their row's token order (`where`: each token's
    sequence and position, None for the plain row), sent to the device by `send`; None without `routes`."""
    if routes is None:
        return None
    lengths = [len(prompt) + len(completion) for prompt, completion in sequences]
    experts, valid = replay_rows(routes, *(where or plain_sources(lengths)), lengths)
    return RouterReplay(send(experts), send(valid))


class _Slot:
    """What one router replays: its [T, k] column of the current row's record (None: its own top-k)."""

    experts: torch.Tensor | None = None
    valid: torch.Tensor | None = None


def _replayed(router: Any, slot: _Slot, hidden_states: torch.Tensor):
    """Qwen3MoeTopKRouter's outputs (logits, combine weights, expert indices) with the slot's experts chosen."""
    if slot.experts is None or slot.valid is None:  # no row to replay: the router's own forward
        return type(router).forward(router, hidden_states)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = F.linear(hidden, router.weight)
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    if slot.experts.shape[0] != hidden.shape[0]:
        raise ValueError(f"train.router_replay: the replayed routing has {slot.experts.shape[0]} rows for a forward "
                         f"of {hidden.shape[0]} tokens (not the packed row it was laid out for)")
    own = torch.topk(probs, slot.experts.shape[1], dim=-1).indices
    experts = torch.where(slot.valid[:, None], slot.experts.long(), own)
    weights = probs.gather(-1, experts)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), experts


def _install(router: nn.Module) -> _Slot:
    """The router's slot and replaying forward, made on first use and kept (see the module docstring)."""
    slot = router.__dict__.get("_cohort_replay_slot")
    if slot is None:
        slot = _Slot()

        @torch.compiler.disable
        def forward(hidden_states: torch.Tensor):
            return _replayed(router, slot, hidden_states)

        router.__dict__["_cohort_replay_slot"] = slot
        router.__dict__["_cohort_replay_forward"] = forward
    return slot


class RouterReplayer:
    """Replays recorded routing in the forwards of `model`: inside `active()` its routers run the replaying forward,
    and `use(replay)` says which packed row's record they take (None: their own top-k) until the next `use`. The
    update opens it around a mini-batch's micro-batches and uses each row's record from its forward to its backward."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.gates: list[nn.Module] | None = None  # found on first use (after any sharding wrapped the model)

    @contextlib.contextmanager
    def active(self) -> Iterator[RouterReplayer]:
        if self.gates is None:
            self.gates = routers(self.model)
        for gate in self.gates:
            _install(gate)
            gate.__dict__["forward"] = gate.__dict__["_cohort_replay_forward"]  # shadows the class's forward
        try:
            yield self
        finally:
            self.use(None)
            for gate in self.gates:
                gate.__dict__.pop("forward", None)

    def use(self, replay: RouterReplay | None) -> None:
        gates = self.gates or []
        if replay is not None:
            layers, k = replay.experts.shape[1], replay.experts.shape[2]
            top_ks = sorted({getattr(g, "top_k", k) for g in gates})
            if layers != len(gates) or top_ks != [k]:
                raise ValueError(f"train.router_replay: the recorded routing has {layers} sparse layers of top-{k}; "
                                 f"{type(self.model).__name__} has {len(gates)} routers of top-{top_ks}")
        for j, gate in enumerate(gates):
            slot = _install(gate)
            slot.experts, slot.valid = (None, None) if replay is None else (replay.experts[:, j], replay.valid)


@contextlib.contextmanager
def replaying(model: nn.Module, replay: RouterReplay | None) -> Iterator[None]:
    """Inside the block every router of `model` routes the tokens of a forward (and its backward's recompute) over the
    packed row `replay` was laid out for to its recorded experts; nothing changes when `replay` is None."""
    if replay is None:
        yield
        return
    with RouterReplayer(model).active() as replayer:
        replayer.use(replay)
        yield

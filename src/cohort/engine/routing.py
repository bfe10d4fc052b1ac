"""Router replay's engine half (train.router_replay): the experts each sparse layer chose for every token the engine
ran through the model, kept per sequence and returned with its completion (`Completion.routed_experts`).

A token is routed when it is *fed* to the model: the prompt (and a continued turn's context, with the turn's last
sampled token) in a prefill, each sampled token in the decode step after the one that sampled it. A sequence of n
tokens therefore has a record for positions 0 .. n - 2; its last token never runs (nothing is sampled after it).
A record is [positions, sparse layers, k] expert indices in a compact integer type (one byte up to 256 experts).

Where the forward writes: the runner calls the net through the recorder (`RouteRecorder.forward*`), which points
`Qwen3MoeForward.route_out` at a [tokens, sparse layers, k] device buffer for that one forward:

- an eager prefill or decode step: a fresh buffer, read back to the host after the forward (`last`);
- the decode graphs: a static [max_num_seqs, S, k] buffer written inside the graph, read after the replay; the
  prefill graphs: one [prefill_graph_tokens, S, k] buffer they share (the padding rows are never read); the
  multi-step graphs: [decode_steps, max_num_seqs, S, k], copied to pinned host memory behind the graph with the
  sampled tokens (two host sets, as the tokens have) and read when the launch is collected.

The engine books the rows into each sequence's `RouteLog` (held here, by sequence) before it appends the step's sampled tokens (so position
len(seq) - 1 is the fed token); a group's samples share their prompt's prefill and get its rows each; a preempted or
evicted sequence recomputed from scratch writes its rows again. With recording off (the default) the recorder
allocates nothing, the forwards are the net's own (`route_out` stays None, no graph holds a copy) and every other
hook returns at once.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from cohort.engine.config import EngineConfig
from cohort.engine.scheduler import ScheduledStep
from cohort.engine.sequence import PrefillUnit, Sequence, Status


class RouteLog:
    """One sequence's record, row p = position p, written in place (grown by doubling)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, capacity: int) -> None:
        self.rows = np.zeros((max(capacity, 1), *shape), dtype=dtype)
        self.filled = 0  # rows 0 .. filled - 1 were written

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.rows):
            grown = np.zeros((max(end, 2 * len(self.rows)), *self.rows.shape[1:]), dtype=self.rows.dtype)
            grown[: len(self.rows)] = self.rows
            self.rows = grown
        self.rows[start:end] = rows
        self.filled = max(self.filled, end)

    def result(self, positions: int) -> np.ndarray:
        """Rows 0 .. positions - 1 (a copy); every one of them must have been written."""
        if self.filled < positions:
            raise RuntimeError(f"router replay: a sequence's routing covers {self.filled} positions, {positions} "
                               "were fed to the model")
        return self.rows[:positions].copy()


class RouteRecorder:
    """The model runner's recording buffers and its forwards that fill them (see the module docstring). `on` is
    False unless the engine was built with record_routes: the forwards are then the net's own, and the rest does
    nothing."""

    def __init__(self, net: Any, config: EngineConfig, steps: int, device: torch.device, pin: bool) -> None:
        self.net, self.on = net, bool(config.record_routes)
        self.logs: weakref.WeakKeyDictionary[Sequence, RouteLog] = weakref.WeakKeyDictionary()
        self.last: np.ndarray | None = None  # an eager step's rows on the host; None after a graph step
        self.shape: tuple[int, ...] = getattr(net, "routing_shape", None) or ()
        if not self.on:
            return
        if not self.shape:
            raise ValueError(f"record_routes=True: {type(net.hf).__name__} has no routed-experts layers, so there is "
                             "no routing to record (router replay is for mixture-of-experts models)")
        dtype, top = net.route_dtype, config.max_num_seqs
        self.numpy_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self.device, self.dtype = device, dtype
        self.decode_rows = torch.zeros((top, *self.shape), dtype=dtype, device=device)
        self.multi_rows = torch.zeros((steps, top, *self.shape), dtype=dtype, device=device)
        self.multi_host = [torch.zeros(self.multi_rows.shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self.prefill_rows = torch.zeros((config.prefill_graph_tokens, *self.shape), dtype=dtype, device=device)

    # ---- the net's forward, writing its routing --------------------------------------------------------
    def _into(self, rows: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self.net.route_out = rows
        try:
            return self.net.forward(*args, **kwargs)
        finally:
            self.net.route_out = None

    def forward(self, tokens: int, *args, **kwargs) -> torch.Tensor:
        """An eager forward of `tokens` tokens; its rows are `last` after it."""
        if not self.on:
            return self.net.forward(*args, **kwargs)
        rows = torch.empty((tokens, *self.shape), dtype=self.dtype, device=self.device)
        hidden = self._into(rows, *args, **kwargs)
        self.last = rows.cpu().numpy()
        return hidden

    def forward_decode(self, bs: int, *args) -> torch.Tensor:
        """The forward a decode graph of `bs` rows captures: it writes into the static decode rows."""
        return self._into(self.decode_rows[:bs], *args) if self.on else self.net.forward(*args)

    def forward_multi(self, step: int, bs: int, *args) -> torch.Tensor:
        """Forward `step` of a multi-step launch: its rows of the multi-step buffer."""
        return self._into(self.multi_rows[step, :bs], *args) if self.on else self.net.forward(*args)

    def forward_prefill(self, padded: int, *args) -> torch.Tensor:
        """The forward a prefill graph of `padded` tokens captures: the shared prefill rows."""
        return self._into(self.prefill_rows[:padded], *args) if self.on else self.net.forward(*args)

    # ---- reading back and booking into the sequences -------------------------------------------------
    def queue_multi(self, which: int) -> None:
        """Queue the copy of a launch's rows to host set `which` (behind its graph, like the tokens' copy)."""
        if self.on:
            self.multi_host[which].copy_(self.multi_rows, non_blocking=True)

    def write(self, seq: Sequence, start: int, rows: np.ndarray) -> None:
        """Rows of positions start .. into `seq`'s record (made on its first rows)."""
        log = self.logs.get(seq)
        if log is None:
            log = self.logs[seq] = RouteLog(self.shape, self.numpy_dtype, len(seq) + min(seq.params.max_tokens, 512))
        log.write(start, rows)

    def result(self, seq: Sequence) -> np.ndarray | None:
        """The record of a finished sequence (every position but its last), or None when off."""
        if not self.on:
            return None
        log = self.logs.pop(seq, None)
        if log is None:
            raise RuntimeError("router replay: a finished sequence has no recorded routing")
        return log.result(len(seq) - 1)

    def book(self, step: ScheduledStep) -> None:
        """The rows of the step just run into its sequences, before its sampled tokens are appended: an eager
        step's `last`, else (a graph replayed) the static rows of its tokens."""
        if not self.on:
            return
        rows, self.last = self.last, None
        if step.is_prefill:
            if rows is None:
                rows = self.prefill_rows[: sum(unit.num_tokens for unit in step.units)].cpu().numpy()
            self._book_prefill(step.units, rows)
            return
        if rows is None:
            rows = self.decode_rows[: len(step.seqs)].cpu().numpy()
        for i, seq in enumerate(step.seqs):
            self.write(seq, len(seq) - 1, rows[i : i + 1])

    def _book_prefill(self, units: list[PrefillUnit], rows: np.ndarray) -> None:
        """A prefill's rows (its units' uncached tokens, in order) into every sequence of each unit."""
        offset = 0
        for unit in units:
            n = unit.num_tokens
            for seq in unit.seqs:
                self.write(seq, unit.leader.num_cached, rows[offset : offset + n])
            offset += n

    def book_multi(self, ticket: int, seqs: list[Sequence], budgets: list[int]) -> None:
        """A collected multi-step launch's rows into the sequences that take its tokens (running, not finished),
        before they are appended: step j fed the token at position len(seq) - 1 + j."""
        if not self.on:
            return
        rows = self.multi_host[ticket].numpy()
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            if budget and seq.status is Status.RUNNING and seq.finish_reason is None:
                self.write(seq, len(seq) - 1, rows[:budget, i])

"""Continued turns' prefill as one decode-shaped forward, replayed from a CUDA graph per padded size.

A continued turn (a tool result appended to a conversation whose KV stays cached) adds a few dozen tokens per
conversation over a prefix of hundreds. The general prefill path (`ModelRunner.prefill`) computes them with the
packed varlen kernel and then redoes their attention over the prefix in a padded batch: an eager forward of about
seventy launches per layer (gathers, masks, SDPA), which on a small model is bound by the host. On the calculator
workload of bench/turns.py (SmolLM2-135M, H200) the continued turns' prefills were most of the idle time between
decode launches.

Here each new token is one row of a decode forward: the layer writes every row's K/V to the cache slot of its
position before it attends, and the paged decode kernel lets row j attend over its sequence's blocks up to its own
position (ctx_len = position + 1). That is causal attention over the cached prefix and the turn's earlier new tokens,
the same as the prefix path computes, with no gathered copies. The shapes are a decode step's with more rows, so one
CUDA graph per padded row count (powers of two from MIN_ROWS up to `max_tokens`) replays the whole forward. Padding
rows read and write only the scratch block, as decode padding does. A graph returns the hidden state of each
sequence's last new token; the LM head runs after the replay (one matmul), so that no graph holds a vocabulary-wide
buffer. The first time a size occurs costs one extra forward (the capture's warm-up, which writes the same K/V).

Used for text models whose decode attention is the paged Triton kernel (CUDA), outside exact-parity mode, when a
prefill step has a continued turn and at most `max_tokens` new tokens; eager (same forward, no graph) without CUDA
graphs or while router replay records. Everything else takes the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cohort.engine.attention import AttnContext
from cohort.engine.sequence import PrefillUnit

MIN_ROWS = 64


def _padded(tokens: int) -> int:
    return max(MIN_ROWS, 1 << max(0, (tokens - 1).bit_length()))


@dataclass
class _Inputs:
    """One step's rows on the host: ids, positions, slots, ctx_lens [T]; per-row block tables [T, W]; the rows of
    each unit's last token [U]."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    ctx_lens: np.ndarray
    tables: np.ndarray
    last: np.ndarray


class ContinuationPrefill:
    """Runs a ModelRunner's prefill steps with continued turns as decode-shaped forwards (module docstring)."""

    def __init__(self, runner, max_tokens: int, graphs: bool) -> None:
        self.runner = runner
        self.max_tokens = max_tokens
        self.use_graphs = graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # rows -> (graph, last hidden)
        self._static: dict[str, torch.Tensor] | None = None
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0

    @staticmethod
    def available(runner, config) -> bool:
        """Whether a runner takes this path at all (see the module docstring)."""
        net = runner.net
        return (bool(config.continuation_graph_tokens) and runner.attention.use_triton
                and getattr(net, "prefill_inputs", None) is None and getattr(net, "exact", None) is None)

    def clear(self) -> None:
        """Drop the graphs (they read the KV pool and the weights by address: recaptured on next use)."""
        self.graphs.clear()

    @torch.inference_mode()
    def maybe_run(self, units: list[PrefillUnit]) -> torch.Tensor | None:
        """Logits [U, V] of each unit's last new token, or None when this step takes the general path."""
        if not any(unit.leader.num_cached for unit in units):
            return None
        tokens = sum(len(unit.leader) - unit.leader.num_cached for unit in units)
        if tokens > self.max_tokens:
            return None
        inputs = self._inputs(units, tokens)
        if self.use_graphs and not self.runner.routes.on:
            hidden = self._replay(inputs, tokens, len(units))
        else:
            hidden = self._eager(inputs)
        return self.runner.net.logits(hidden)

    def _inputs(self, units: list[PrefillUnit], tokens: int) -> _Inputs:
        runner = self.runner
        bs, width = runner.config.block_size, runner.config.max_blocks_per_seq
        counts = np.fromiter((len(u.leader) - u.leader.num_cached for u in units), dtype=np.int64, count=len(units))
        positions = np.concatenate([np.arange(u.leader.num_cached, len(u.leader)) for u in units])
        ids = np.fromiter((t for u in units for t in u.leader.token_ids[u.leader.num_cached:]), dtype=np.int64,
                          count=tokens)
        tables = np.full((len(units), width), runner.scratch_block, dtype=np.int32)
        for i, unit in enumerate(units):
            tables[i, : len(unit.leader.block_table)] = unit.leader.block_table
        row_tables = np.repeat(tables, counts, axis=0)  # each new token reads its own sequence's blocks
        owner = np.repeat(np.arange(len(units)), counts)
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        return _Inputs(ids, positions, slots, (positions + 1).astype(np.int32), row_tables, np.cumsum(counts) - 1)

    def _eager(self, inputs: _Inputs) -> torch.Tensor:
        runner, dev = self.runner, self.runner.device
        ctx = AttnContext(is_prefill=False, slot_mapping=torch.from_numpy(inputs.slots).to(dev),
                          block_tables=torch.from_numpy(inputs.tables).to(dev),
                          ctx_lens=torch.from_numpy(inputs.ctx_lens).to(dev),
                          max_ctx_len=int(inputs.ctx_lens.max()))
        ids, positions = torch.from_numpy(inputs.ids).to(dev), torch.from_numpy(inputs.positions).to(dev)
        hidden = runner.routes.forward(len(inputs.ids), ids, positions, ctx, runner._cache())
        self.eager_runs += 1
        return hidden[torch.from_numpy(inputs.last).to(dev)]

    def _buffers(self) -> dict[str, torch.Tensor]:
        if self._static is None:
            runner, top = self.runner, _padded(self.max_tokens)
            dev, width = runner.device, runner.config.max_blocks_per_seq
            self._static = {
                "ids": torch.zeros(top, dtype=torch.int64, device=dev),
                "positions": torch.zeros(top, dtype=torch.int64, device=dev),
                "slots": torch.zeros(top, dtype=torch.int64, device=dev),
                "ctx_lens": torch.ones(top, dtype=torch.int32, device=dev),
                "tables": torch.zeros((top, width), dtype=torch.int32, device=dev),
                "last": torch.zeros(top, dtype=torch.int64, device=dev),
            }
        return self._static

    def _replay(self, inputs: _Inputs, tokens: int, units: int) -> torch.Tensor:
        rows = _padded(tokens)
        static = self._buffers()
        scratch = self.runner.scratch_block
        host: dict[str, np.ndarray] = {
            "ids": np.zeros(rows, dtype=np.int64), "positions": np.zeros(rows, dtype=np.int64),
            "slots": np.full(rows, scratch * self.runner.config.block_size, dtype=np.int64),
            "ctx_lens": np.ones(rows, dtype=np.int32),
            "tables": np.full((rows, static["tables"].shape[1]), scratch, dtype=np.int32),
            "last": np.zeros(rows, dtype=np.int64),
        }
        for name, values in (("ids", inputs.ids), ("positions", inputs.positions), ("slots", inputs.slots),
                             ("ctx_lens", inputs.ctx_lens), ("tables", inputs.tables), ("last", inputs.last)):
            host[name][: len(values)] = values
            static[name][:rows].copy_(torch.from_numpy(host[name]), non_blocking=False)
        captured = self.graphs.get(rows) or self._capture(rows)
        captured[0].replay()  # after a capture too: capturing runs nothing, the output is filled by a replay
        self.replays += 1
        return captured[1][:units].clone()  # a copy: the output lives in the pool the decode graphs share

    def _capture(self, rows: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        runner, static = self.runner, self._buffers()
        ctx = AttnContext(is_prefill=False, slot_mapping=static["slots"][:rows],
                          block_tables=static["tables"][:rows], ctx_lens=static["ctx_lens"][:rows])

        def forward() -> torch.Tensor:
            hidden = runner.net.forward(static["ids"][:rows], static["positions"][:rows], ctx, runner._cache())
            return hidden[static["last"][:rows]]

        graph, out = runner.capture_graph(forward, runner.graph_pool())
        self.graphs[rows] = (graph, out)
        self.captures += 1
        return graph, out

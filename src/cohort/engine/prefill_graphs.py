"""CUDA graphs of the prefill forward of fresh prompts, one per padded shape, captured when first needed.

A prefill of a few thousand tokens on a small model is bound by the host: each of its ~300 operations
(compiled norms, cuBLAS calls, varlen attention, the fused RoPE + KV write) costs tens of microseconds of
Python and dispatch, more than the device needs for it (workload A of bench/rollout.py, 32 prompts of 128
tokens on the 0.5B model: 26 ms of wall time for 8 ms of device work). A graph replays the same kernels with
no host work in between.

Shapes: the packed tokens are padded to a multiple of TOKEN_STEP, the sequences to a power of two (plus one
for the padding), the longest sequence to a power of two. The padding tokens (id 0, positions from 0) form
one extra sequence that attends only to itself and writes its K/V to the scratch block (no live sequence
reads it), and the remaining sequence slots are empty (cu_seqlens repeats the total). All of it computes
finite values, so nothing else sees it: the graph's logits for the real sequences are those of the eager
forward. A graph is used only for fresh prompts (no cached prefix), text models, varlen attention and
totals up to `max_tokens` (EngineConfig.prefill_graph_tokens); the rest runs eagerly as before. Graphs share
the decode graphs' memory pool and are dropped whenever those are recaptured (a moved KV pool or weights).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from cohort.engine.attention import AttnContext

TOKEN_STEP = 512
MAX_GRAPHS = 8  # least recently used graphs beyond this are released (each holds its logits buffer)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cu: torch.Tensor
    last: torch.Tensor
    logits: torch.Tensor


class PrefillGraphs:
    """Captures and replays prefill graphs for a ModelRunner (see the module docstring)."""

    def __init__(self, runner, max_tokens: int) -> None:
        self.runner = runner
        self.max_tokens = max_tokens
        self.graphs: OrderedDict[tuple[int, int, int], _Captured] = OrderedDict()
        self.captures = 0
        self.replays = 0

    def shape(self, tokens: int, seqs: int, longest: int) -> tuple[int, int, int] | None:
        """(padded tokens, sequence slots, max sequence length) of a prefill, or None when it runs eagerly."""
        padded = -(-tokens // TOKEN_STEP) * TOKEN_STEP
        if padded > self.max_tokens:
            return None
        return padded, _pow2(seqs + 1), _pow2(max(longest, padded - tokens, 1))

    def clear(self) -> None:
        self.graphs.clear()

    @torch.inference_mode()
    def run(self, key: tuple[int, int, int], ids: list[int], positions: np.ndarray, slots: np.ndarray,
            cu: list[int]) -> torch.Tensor:
        """Logits [len(cu) - 1, vocab] of each sequence's last position, through the graph of `key`."""
        padded, slots_n, _ = key
        tokens, seqs = len(ids), len(cu) - 1
        captured = self.graphs.get(key)
        fresh = captured is None
        if captured is None:
            captured = self._buffers(key)
        scratch = self.runner.scratch_block * self.runner.config.block_size
        host = np.zeros((3, padded), dtype=np.int64)
        host[0, :tokens] = ids
        host[1, :tokens] = positions
        host[1, tokens:] = np.arange(padded - tokens) % self.runner.config.max_model_len  # inside the RoPE table
        host[2, :tokens] = slots
        host[2, tokens:] = scratch
        bounds = np.full(slots_n + 1, padded, dtype=np.int32)
        bounds[: seqs + 1] = cu
        last = np.zeros(slots_n, dtype=np.int64)
        last[:seqs] = np.asarray(cu[1:]) - 1
        rows = torch.from_numpy(host)
        for buffer, values in ((captured.ids, rows[0]), (captured.positions, rows[1]), (captured.slots, rows[2]),
                               (captured.cu, torch.from_numpy(bounds)), (captured.last, torch.from_numpy(last))):
            buffer.copy_(values)
        if fresh:
            self._capture(key, captured)
        self.graphs.move_to_end(key)
        captured.graph.replay()
        self.replays += 1
        # a copy: the graph's output lives in the pool the decode graphs share
        return captured.logits[:seqs].clone()

    def _buffers(self, key: tuple[int, int, int]) -> _Captured:
        padded, slots_n, _ = key
        dev = self.runner.device
        return _Captured(
            graph=torch.cuda.CUDAGraph(),
            ids=torch.zeros(padded, dtype=torch.int64, device=dev),
            positions=torch.zeros(padded, dtype=torch.int64, device=dev),
            slots=torch.zeros(padded, dtype=torch.int64, device=dev),
            cu=torch.zeros(slots_n + 1, dtype=torch.int32, device=dev),
            last=torch.zeros(slots_n, dtype=torch.int64, device=dev),
            logits=torch.empty(0, device=dev),
        )

    def _capture(self, key: tuple[int, int, int], captured: _Captured) -> None:
        runner = self.runner
        longest = key[2]
        ctx = AttnContext(is_prefill=True, slot_mapping=captured.slots, cu_seqlens=captured.cu,
                          cu_seqlens_host=None, max_seqlen=longest)

        def forward() -> torch.Tensor:
            hidden = runner.routes.forward_prefill(key[0], captured.ids, captured.positions, ctx, runner._cache())
            return runner.net.logits(hidden[captured.last])

        captured.graph, captured.logits = runner.capture_graph(forward, runner.graph_pool())
        self.graphs[key] = captured
        self.captures += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)

"""Model runner: owns the KV cache, builds each step's packed inputs, runs the forward, replays CUDA graphs.

KV cache: one tensor [2, layers, num_blocks + 1, block_size, kv_heads, head_dim] in the model's dtype. The
number of blocks comes from the device's free memory times `kv_cache_fraction` (taken after the trainer's
weights, gradients and optimizer state exist), capped at what max_num_seqs sequences of max_model_len can
use, so the engine never allocates past what is free. Block `num_blocks` is scratch for CUDA-graph padding.
With EngineConfig.fit_context_to_kv (the model's context as max_model_len) a pool smaller than one sequence of
it lowers max_model_len to the pool's size instead of failing.

Decode steps on CUDA replay a graph captured for the smallest captured batch size >= the live batch; the
padded rows write to and read from the scratch block, so they never touch a live sequence's KV.

Multi-step decode (`launch_multi` / `collect_multi` from engine/multi_step.py; EngineConfig.decode_steps = K): one
graph runs K forwards; after each, the in-graph sampler's tokens become the next step's inputs and the positions,
context lengths and KV slots (looked up in the block tables, which the scheduler filled ahead) advance on the device.
A row stops advancing after its budget (max_tokens), writing to the scratch block from then on. The host fills the
inputs and reads the K x B tokens once per K steps. Prefill steps of continued turns: engine/continuation_graphs.py.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import torch

from cohort.engine import multi_step, triton_ops
from cohort.engine.attention import AttentionOps, AttnContext, prefix_batch
from cohort.engine.config import EngineConfig
from cohort.engine.continuation_graphs import ContinuationPrefill
from cohort.engine.models.decoder import HFModule
from cohort.engine.models.registry import build_forward
from cohort.engine.prefill_graphs import PrefillGraphs
from cohort.engine.routing import RouteRecorder
from cohort.engine.sampler import temperature_rows
from cohort.engine.scheduler import PrefillUnit
from cohort.engine.sequence import Sequence
from cohort.engine.triton_ops import fused_sample
from cohort.policy.context import CPU_KV_BUDGET

# Decode graphs of the gather attention (no Triton kernel for the head size) copy every row's K/V over the whole
# table width: batch sizes whose copies pass this many bytes run eagerly, over the live contexts only.
GATHER_GRAPH_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, model: HFModule, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        dtype = model.get_input_embeddings().weight.dtype
        text = model.config.get_text_config()  # a vision-language model's language model config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.attention = AttentionOps(device, dtype, head_dim, config.block_size)
        self.net = build_forward(model, self.attention, config.max_model_len, config.fuse_projections)
        self.num_blocks = self._num_blocks()
        self.scratch_block = self.num_blocks
        self._kv_shape = (2, self.net.num_layers, self.num_blocks + 1, config.block_size, self.net.num_kv_heads,
                          self.net.head_dim)
        self.kv_cache: torch.Tensor | None = None
        self._kv_ptr: int | None = None
        self.graph_recaptures = 0
        self.ensure_kv_cache()
        width = config.max_blocks_per_seq
        pin = device.type == "cuda"
        self._tables_host = torch.full((config.max_num_seqs, width), self.scratch_block, dtype=torch.int32,
                                       pin_memory=pin)
        # Per-row decode inputs: ids, positions, slots, ctx_lens, seeds, budgets (int64) and 1/T, noise (float32).
        self._row_host = torch.zeros((6, config.max_num_seqs), dtype=torch.int64, pin_memory=pin)
        self._float_host = torch.ones((2, config.max_num_seqs), dtype=torch.float32, pin_memory=pin)
        self._out_tokens = torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=pin)
        self._out_logprobs = torch.zeros(config.max_num_seqs, dtype=torch.float32, pin_memory=pin)
        # The fused sampler joins the decode graph, so a plain-sampling step is a single graph replay.
        self.sample_in_graph = triton_ops.triton is not None and device.type == "cuda"
        self.graphs: dict[int, tuple] = {}  # batch size -> (graph, logits, tokens, logprobs)
        self.multi_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> graph of decode_steps steps
        self._graph_logits: torch.Tensor | None = None
        self.graph_capture_seconds = 0.0
        use_graphs = device.type == "cuda" and not config.enforce_eager and self.net.graph_safe
        steps = config.decode_steps
        self.decode_steps = steps if steps is not None else (8 if use_graphs and self.sample_in_graph else 1)
        self.routes = RouteRecorder(self.net, config, self.decode_steps, device, pin)  # router replay's records
        self._alloc_static(pin)
        self._param_ptrs = self._parameter_pointers()
        self._pool = None  # the decode graphs' memory pool, shared by the prefill graphs
        self.prefill_graphs = (PrefillGraphs(self, config.prefill_graph_tokens)
                               if use_graphs and config.prefill_graph_tokens and self.attention.use_varlen
                               and getattr(self.net, "prefill_inputs", None) is None else None)
        self.continuations = (ContinuationPrefill(self, config.continuation_graph_tokens, use_graphs)
                              if ContinuationPrefill.available(self, config) else None)
        # graph_safe is False for a forward that reads values on the host (the MoE's per-expert loop).
        if use_graphs:
            with torch.cuda.device(device):
                self._capture_graphs()

    def _alloc_static(self, pin: bool) -> None:
        """The device-side decode inputs the graphs read (and the multi-step loop advances) and their outputs."""
        top, width, dev = self.config.max_num_seqs, self.config.max_blocks_per_seq, self.device
        self._static_rows = torch.zeros((6, top), dtype=torch.int64, device=dev)
        self._static_floats = torch.ones((2, top), dtype=torch.float32, device=dev)
        self._static_rows[2] = self.scratch_block * self.config.block_size
        self._static_rows[3] = 1
        self._static_tables = torch.full((top, width), self.scratch_block, dtype=torch.int32, device=dev)
        self._static_ctx_lens = torch.ones(top, dtype=torch.int32, device=dev)
        steps = self.decode_steps
        self._multi_tokens = torch.zeros((steps, top), dtype=torch.int64, device=dev)
        self._multi_logprobs = torch.zeros((steps, top), dtype=torch.float32, device=dev)
        # Two host-side sets for the multi-step pipeline: a chained launch fills one while the other's copies
        # may still be queued behind the running graph.
        self._multi_host = [self._row_host, torch.zeros((6, top), dtype=torch.int64, pin_memory=pin)]
        self._multi_float_host = [self._float_host, torch.ones((2, top), dtype=torch.float32, pin_memory=pin)]
        self._multi_tables_host = [self._tables_host, torch.full((top, width), self.scratch_block, dtype=torch.int32,
                                                                 pin_memory=pin)]
        self._multi_out = [(torch.zeros((steps, top), dtype=torch.int64, pin_memory=pin),
                            torch.zeros((steps, top), dtype=torch.float32, pin_memory=pin)) for _ in range(2)]
        self._multi_events: list = [None, None]
        self._multi_turn = 0

    def _parameter_pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.net.hf.parameters()]

    def sync_weights(self) -> None:
        """After an optimizer step or a push: refresh fused copies; recapture graphs if parameters moved in memory.
        Optimizers update parameters in place, so captured graphs stay valid; a trainer that swaps the storage
        (load_state_dict(assign=True), some sharding wrappers) would leave graphs reading stale memory."""
        if self.net.fused:
            self.net.refresh_fused()
        pointers = self._parameter_pointers()
        if pointers != self._param_ptrs:
            self._param_ptrs = pointers
            if self.graphs:
                self.graphs.clear()
                self._capture_graphs()

    # ---- memory ------------------------------------------------------------------------------------
    def release_kv_cache(self) -> None:
        """Free the KV pool between generate calls (no sequence holds a block then), so a training update can
        use the memory; `ensure_kv_cache` takes it back. The memory stays in PyTorch's caching allocator, so
        the pool normally returns at the same address and the captured graphs stay valid."""
        self.kv_cache = None

    def ensure_kv_cache(self) -> None:
        """Allocate the KV pool if it was released; recapture the graphs if it moved (they read it by address)."""
        if self.kv_cache is not None:
            return
        dtype = self.net.dtype
        with torch.inference_mode():
            # zeros, not empty: CUDA-graph padding rows read the scratch block
            self.kv_cache = torch.zeros(self._kv_shape, dtype=dtype, device=self.device)
        pointer = self.kv_cache.data_ptr()
        moved = self._kv_ptr is not None and pointer != self._kv_ptr
        self._kv_ptr = pointer
        if moved and self.graphs:
            self.graphs.clear()
            self.graph_recaptures += 1
            with torch.cuda.device(self.device):
                self._capture_graphs()

    def _cache(self) -> torch.Tensor:
        """The KV pool; generate() takes it back (ensure_kv_cache) before any step runs."""
        if self.kv_cache is None:
            raise RuntimeError("the KV cache is released: call ensure_kv_cache() before running the model")
        return self.kv_cache

    def bytes_per_block(self) -> int:
        net = self.net
        return 2 * net.num_layers * self.config.block_size * net.num_kv_heads * net.head_dim * net.dtype.itemsize

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        cap = cfg.max_num_seqs * cfg.max_blocks_per_seq
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
        else:
            free = CPU_KV_BUDGET
        fit = int(free * cfg.kv_cache_fraction) // self.bytes_per_block()
        if cfg.fit_context_to_kv and 1 <= fit < cfg.max_blocks_per_seq:
            cfg.max_model_len = fit * cfg.block_size  # what one sequence can have in the pool
        if fit < cfg.max_blocks_per_seq:
            raise RuntimeError(
                f"kv_cache_fraction={cfg.kv_cache_fraction} of {free / 2**30:.1f} GiB free gives {fit} KV blocks, "
                f"fewer than one sequence of max_model_len={cfg.max_model_len} needs ({cfg.max_blocks_per_seq}); "
                "raise kv_cache_fraction or lower max_model_len."
            )
        return min(cap, fit)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks src -> dst in every layer (a forked sample's private last prompt block)."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        with torch.inference_mode():
            cache = self._cache()
            cache[:, :, dst] = cache[:, :, src]

    # ---- prefill -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, units: list[PrefillUnit]) -> torch.Tensor:
        """Forward the leaders' uncached tokens (all of them, or a continued turn's new ones); returns logits of
        each leader's last position [U, V]."""
        if self.continuations is not None and (logits := self.continuations.maybe_run(units)) is not None:
            return logits
        bs = self.config.block_size
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        cu = [0]
        prefix_lens: list[int] = []
        for unit in units:
            seq = unit.leader
            n, cached = len(seq), seq.num_cached
            ids.extend(seq.token_ids[cached:])
            pos = np.arange(cached, n)
            positions.append(pos)
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n - cached)
            prefix_lens.append(cached)
        dev = self.device
        longest = max(b - a for a, b in itertools.pairwise(cu))
        # (use_varlen turns False for good if varlen_attn ever fails: the graphs capture it)
        if self.prefill_graphs is not None and self.attention.use_varlen and not any(prefix_lens):
            key = self.prefill_graphs.shape(len(ids), len(units), longest)
            if key is not None:
                return self.prefill_graphs.run(key, ids, np.concatenate(positions), np.concatenate(slots), cu)
        ctx = AttnContext(
            is_prefill=True,
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev),
            cu_seqlens_host=cu,
            max_seqlen=longest,
        )
        if any(prefix_lens):
            # continued turns attend to their cached prefix, all of the step's in one padded batch per layer
            turns = [(cu[i], cu[i + 1] - cu[i], c) for i, c in enumerate(prefix_lens) if c]
            ctx.prefix_lens = prefix_lens
            ctx.prefix_batch = prefix_batch(turns, [u.leader.block_table for u, c in zip(units, prefix_lens) if c],
                                            bs, dev)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(dev)
        # prompts with images (cohort.vision.engine_forward): embeddings with image features, multimodal RoPE rows
        prefill_inputs = getattr(self.net, "prefill_inputs", None)
        extra = prefill_inputs(units, input_ids, pos_t) if prefill_inputs is not None else None
        hidden = self.routes.forward(len(ids), input_ids, pos_t, ctx, self._cache(), **(extra or {}))
        last = torch.tensor(cu[1:], device=dev) - 1
        return self.net.logits(hidden[last])

    # ---- decode ------------------------------------------------------------------------------------
    def _fill_decode_inputs(self, seqs: list[Sequence], rows: int, budgets: list[int] | None = None,
                            which: int = 0) -> None:
        """Write ids/positions/slots/ctx_lens/seeds/budgets/tables of `rows` rows (live ones first, then
        padding, whose budget is 0) into host set `which` (0 for one-step decode)."""
        bs = self.config.block_size
        host = self._multi_host[which].numpy()
        tables = self._multi_tables_host[which].numpy()
        n = len(seqs)
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        host[0, :n] = [s.token_ids[-1] for s in seqs]
        host[1, :n] = lengths - 1 + np.fromiter((s.rope_delta for s in seqs), dtype=np.int64, count=n)
        last_blocks = np.fromiter((s.block_table[(len(s) - 1) // bs] for s in seqs), dtype=np.int64, count=n)
        host[2, :n] = last_blocks * bs + (lengths - 1) % bs
        host[3, :n] = lengths
        host[4, :n] = np.fromiter((s.seed for s in seqs), dtype=np.int64, count=n)
        host[5, :n] = budgets if budgets is not None else 1
        floats = self._multi_float_host[which].numpy()
        floats[0, :n], floats[1, :n] = temperature_rows(seqs)
        self._fill_tables(tables, seqs)
        host[0, n:rows] = 0
        host[1, n:rows] = 0
        host[2, n:rows] = self.scratch_block * bs
        host[3, n:rows] = 1
        host[5, n:rows] = 0
        tables[n:rows, 0] = self.scratch_block

    @staticmethod
    def _fill_tables(tables: np.ndarray, seqs: list[Sequence]) -> None:
        """All block tables in one scatter (a per-row numpy assignment costs ~2 us x 256 rows per step)."""
        n = len(seqs)
        counts = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=n)
        flat = np.fromiter(itertools.chain.from_iterable(s.block_table for s in seqs), dtype=np.int32,
                           count=int(counts.sum()))
        row_ids = np.repeat(np.arange(n), counts)
        col_ids = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
        tables[row_ids, col_ids] = flat

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence], fused_sampling: bool = True):
        """One token for each sequence. Returns (logits [B, V], sampled), where sampled is
        (tokens, logprobs) lists when the in-graph sampler served the step (plain sampling), else None."""
        n = len(seqs)
        graph_bs = next((b for b in sorted(self.graphs) if b >= n), None)
        rows = graph_bs or n
        self._fill_decode_inputs(seqs, rows)
        if graph_bs is not None:
            self._static_rows.copy_(self._row_host, non_blocking=True)
            self._static_floats.copy_(self._float_host, non_blocking=True)
            self._static_tables.copy_(self._tables_host, non_blocking=True)
            graph, logits, tokens, logprobs = self.graphs[graph_bs]
            graph.replay()
            if not (fused_sampling and tokens is not None):
                return logits[:n], None
            self._out_tokens[:n].copy_(tokens[:n], non_blocking=True)
            self._out_logprobs[:n].copy_(logprobs[:n], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            return logits[:n], (self._out_tokens[:n].tolist(), self._out_logprobs[:n].tolist())
        rows_dev = self._row_host[:, :n].to(self.device)
        ctx = AttnContext(
            is_prefill=False,
            slot_mapping=rows_dev[2],
            block_tables=self._tables_host[:n].to(self.device),
            ctx_lens=rows_dev[3].to(torch.int32),
            max_ctx_len=max(len(s) for s in seqs),
        )
        return self.net.logits(self.routes.forward(n, rows_dev[0], rows_dev[1], ctx, self._cache())), None

    # ---- multi-step decode (engine/multi_step.py) --------------------------------------------------
    launch_multi = multi_step.launch
    collect_multi = multi_step.collect
    _multi_step_body = multi_step.body

    # ---- CUDA graphs -------------------------------------------------------------------------------
    def graph_batch_sizes(self) -> list[int]:
        top, net = self.config.max_num_seqs, self.net
        sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16)) + [top]
        if not self.attention.use_triton:  # see GATHER_GRAPH_BYTES: K/V copies of max_model_len per row
            row = 2 * (net.num_heads + net.num_kv_heads) * self.config.max_model_len * net.head_dim * net.dtype.itemsize
            sizes = [b for b in sizes if b * row <= GATHER_GRAPH_BYTES]
        return sorted(set(sizes))

    def graph_pool(self):
        """The memory pool of this runner's CUDA graphs (a new one before the first capture)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        start = time.perf_counter()
        for graphs in (self.prefill_graphs, self.continuations):  # they read the same KV pool and weights by address
            if graphs is not None:
                graphs.clear()
        top = self.config.max_num_seqs
        # One logits buffer for every batch size: a graph's outputs stay allocated for as long as the graph
        # lives, so separate outputs would hold sum(batch sizes) x vocab logits (0.6 GB on Qwen2.5-0.5B).
        vocab = self.vocab_size
        self._graph_logits = (torch.empty((top, vocab), dtype=self.net.dtype, device=self.device)
                              if vocab else None)
        pool = self.graph_pool()
        for bs in reversed(self.graph_batch_sizes()):
            ctx = AttnContext(is_prefill=False, slot_mapping=self._static_rows[2, :bs],
                              block_tables=self._static_tables[:bs], ctx_lens=self._static_ctx_lens[:bs])
            ids, pos = self._static_rows[0, :bs], self._static_rows[1, :bs]

            def run(ctx=ctx, ids=ids, pos=pos, bs=bs):
                self._static_ctx_lens.copy_(self._static_rows[3].to(torch.int32))
                out = None if self._graph_logits is None else self._graph_logits[:bs]
                logits = self.net.logits(self.routes.forward_decode(bs, ids, pos, ctx, self._cache()), out=out)
                if not self.sample_in_graph:
                    return logits, None, None
                # The sampled token sits at position ctx_len (row 3): the key of sampler.row_key.
                rows, floats = self._static_rows, self._static_floats
                drawn = fused_sample(logits, logits, floats[0, :bs], floats[1, :bs], rows[4, :bs], rows[3, :bs])
                return logits, drawn[0], self.net.sampled_logprobs(logits, *drawn, floats[0, :bs])  # exact parity

            graph, outputs = self._capture(run, pool, bs)
            self.graphs[bs] = (graph, *outputs)
        if self.decode_steps > 1:
            for bs in reversed(self.graph_batch_sizes()):
                graph, _ = self._capture(lambda bs=bs: self._multi_step_body(bs), pool, bs)
                self.multi_graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        self.graph_capture_seconds = time.perf_counter() - start

    def _reset_static_rows(self, bs: int) -> None:
        """Padding values in the first `bs` static rows: a warm-up run reads and writes only the scratch block
        (a recapture after a weight or KV move would otherwise write at the last decode's slots)."""
        self._static_rows[:, :bs] = 0
        self._static_rows[2, :bs] = self.scratch_block * self.config.block_size
        self._static_rows[3, :bs] = 1
        self._static_tables[:bs] = self.scratch_block

    def _capture(self, run, pool, bs: int):
        self._reset_static_rows(bs)
        return self.capture_graph(run, pool)

    def capture_graph(self, run, pool):
        """(graph, outputs) of `run` captured into `pool`, after one warm-up call outside the capture (it
        compiles kernels and initialises cuBLAS handles); the prefill graphs capture through it too."""
        run()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = run()
        return graph, outputs

    @property
    def vocab_size(self) -> int | None:
        """The LM head's output width (None for a head that is not a plain projection)."""
        return getattr(getattr(self.net.hf, "lm_head", None), "out_features", None)

"""Attention over the paged KV cache: a plain PyTorch path (CPU, CI) and a GPU path.

Layout of one layer's cache: k_cache, v_cache of shape [num_blocks + 1, block_size, num_kv_heads, head_dim];
the extra last block is a scratch block that padded rows of a CUDA-graph batch write into and read from.

Prefill of a fresh prompt (or a recomputed, preempted sequence) starts at position 0, so it is causal
attention within each packed sequence (`varlen_attn` on the GPU, SDPA per sequence on the CPU) and never
reads the cache. A continued turn of a multi-turn sequence starts after its cached prefix: its new tokens
attend to the prefix through its block table (gather + SDPA with an offset causal mask, on every device;
those are only the few tokens of a tool result). Decode reads each sequence's blocks through its block table
(a Triton kernel on the GPU, gather + SDPA elsewhere).

Sliding-window layers (Mistral, Gemma 3's local layers, Qwen with use_sliding_window) pass `window=W`: a query at
position p sees keys p - W + 1 .. p (W keys, itself included), the same rule as transformers'
`sliding_window_overlay` (kv > q - W). Every path applies it: a mask on the CPU, flash-attention's
window_size=(W - 1, 0) in `varlen_attn`, and a lower bound on the key positions in the Triton decode kernel.
The cache still keeps every token of a windowed layer (correctness first; no ring buffer).
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cohort.engine import triton_ops
from cohort.engine.triton_ops import paged_decode_attention
from cohort.forward.packed_attention import grouped_kv, prepare_flash, varlen_attn


@dataclass
class AttnContext:
    """Per-step metadata shared by all layers.

    slot_mapping: [T] cache slot (block * block_size + offset) each new token's K/V is written to.
    Prefill: cu_seqlens [N+1] int32 on the device, cu_seqlens_host its list, max_seqlen.
    Decode: block_tables [B, max_blocks] int32, ctx_lens [B] int32 (tokens to attend, the new one included),
    max_ctx_len a host bound (None under a CUDA graph: then the full table width is read).
    Prefill of continued turns: prefix_lens [N] host ints (cached tokens before each sequence's new ones, 0
    for a fresh one) and prefix_batch (the continued turns padded into one batch, see PrefixBatch); or instead
    prefix_tables, each such sequence's block table (long, on the device; None for 0), attended one by one.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_host: list[int] | None = None
    max_seqlen: int = 0
    block_tables: torch.Tensor | None = None
    ctx_lens: torch.Tensor | None = None
    max_ctx_len: int | None = None
    prefix_lens: list[int] | None = None
    prefix_tables: list[torch.Tensor | None] | None = None
    prefix_batch: PrefixBatch | None = None


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K/V ([T, kv_heads, head_dim]) into their slots (graph-capturable, no host sync)."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def window_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Lq, Lk] booleans: key at or before the query and, with a window W, within its last W positions."""
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask


def prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, scale: float,
                 window: int | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) attention per packed sequence with SDPA.
    q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    out = torch.empty_like(q)
    cu = ctx.cu_seqlens_host
    assert cu is not None  # set on every prefill context
    groups = q.shape[1] // k.shape[1]
    for start, end in itertools.pairwise(cu):
        qi = q[start:end].transpose(0, 1)
        ki = k[start:end].transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[start:end].transpose(0, 1).repeat_interleave(groups, 0)
        if window is None or end - start <= window:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale)
        else:
            pos = torch.arange(end - start, device=q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=window_mask(pos, pos, window)[None], scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def prefix_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, cached: int,
                scale: float, window: int | None = None) -> torch.Tensor:
    """Attention of a continued turn's L new tokens (q [L, H, D], their K/V already stored) over its cached
    prefix and themselves: query j sits at position cached + j and sees keys 0..cached + j (the last
    `window` of them on a sliding-window layer). -> [L, H, D]."""
    length = q.shape[0]
    total = cached + length
    k = k_cache[table].flatten(0, 1)[:total].transpose(0, 1)  # [Hkv, S, D]
    v = v_cache[table].flatten(0, 1)[:total].transpose(0, 1)
    groups = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(groups, 0)
    v = v.repeat_interleave(groups, 0)
    keys = torch.arange(total, device=q.device)
    mask = window_mask(cached + torch.arange(length, device=q.device), keys, window)  # [L, S]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1)


@dataclass
class PrefixBatch:
    """Every continued turn of a prefill step, padded into one batch (built once per step, used by each layer).

    rows [N, L] long: each turn's new tokens' rows in the packed step (padding: row 0); positions [N, L] long:
    their positions (padding: 0, so a padded query sees key 0 and SDPA never gets an empty row); tables [N, W]
    long: block tables padded with block 0 (masked out); lengths: new tokens per turn (host); total: keys read
    per turn (W * block size). Chunk index tensors are built on first use and kept for the other layers."""

    rows: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    lengths: list[int]
    total: int
    _chunks: dict = field(default_factory=dict)

    def chunk_indices(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat indices of the valid rows of turns a..b-1 in their [C * L] block, their packed rows)."""
        if (a, b) not in self._chunks:
            width = self.rows.shape[1]
            flat = [i * width + j for i, n in enumerate(self.lengths[a:b]) for j in range(n)]
            src = torch.tensor(flat, dtype=torch.long).to(self.rows.device)
            self._chunks[(a, b)] = (src, self.rows[a:b].flatten()[src])
        return self._chunks[(a, b)]


def prefix_batch(turns: list[tuple[int, int, int]], tables: list[list[int]], block_size: int,
                 device: torch.device) -> PrefixBatch:
    """`turns[i] = (start row in the packed step, new tokens, cached tokens)` of continued turn i."""
    n = len(turns)
    length = max(new for _, new, _ in turns)
    width = max(len(t) for t in tables)
    rows = torch.zeros((n, length), dtype=torch.long)
    positions = torch.zeros((n, length), dtype=torch.long)
    table = torch.zeros((n, width), dtype=torch.long)
    for i, ((start, new, cached), t) in enumerate(zip(turns, tables)):
        rows[i, :new] = torch.arange(start, start + new)
        positions[i, :new] = torch.arange(cached, cached + new)
        table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    return PrefixBatch(rows.to(device), positions.to(device), table.to(device), [new for _, new, _ in turns],
                       width * block_size)


def prefix_sdpa_batched(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: PrefixBatch, scale: float, window: int | None = None,
                        max_elements: int = 1 << 27) -> None:
    """`prefix_sdpa` for all continued turns of a step at once (a fixed number of kernels, not a dozen per turn
    and layer; no host sync): writes their attention outputs into `out` (packed rows [T, H, D]). Turns go in
    chunks whose gathered keys stay under `max_elements` elements."""
    n = batch.rows.shape[0]
    heads, dim = q.shape[1], q.shape[2]
    chunk = max(1, max_elements // max(1, batch.total * heads * dim))
    keys = torch.arange(batch.total, device=q.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        pos = batch.positions[a:b]  # [C, L]
        mask = keys[None, None, :] <= pos[:, :, None]  # [C, L, S]
        if window is not None:
            mask &= keys[None, None, :] > pos[:, :, None] - window
        tables = batch.tables[a:b]
        k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [C, Hkv, S, D]
        v = v_cache[tables].flatten(1, 2).transpose(1, 2)
        groups = heads // k.shape[1]
        k = k.repeat_interleave(groups, 1)
        v = v.repeat_interleave(groups, 1)
        rows = batch.rows[a:b]
        qb = q[rows].transpose(1, 2)  # [C, H, L, D]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask[:, None], scale=scale).transpose(1, 2)
        src, dest = batch.chunk_indices(a, b)
        out[dest] = o.flatten(0, 1)[src].to(out.dtype)


def decode_gather(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttnContext,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention by gathering each sequence's blocks into a padded tensor. q [B, H, D] -> [B, H, D].
    The new token sits at position ctx_len - 1; with a window W it sees positions ctx_len - W .. ctx_len - 1."""
    block_tables, ctx_lens = ctx.block_tables, ctx.ctx_lens
    assert block_tables is not None and ctx_lens is not None  # set on every decode context
    block_size = k_cache.shape[1]
    width = block_tables.shape[1]
    if ctx.max_ctx_len is not None:
        width = min(width, -(-ctx.max_ctx_len // block_size))
    tables = block_tables[:, :width].long()
    k = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[tables].flatten(1, 2).transpose(1, 2)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, 1)
    v = v.repeat_interleave(groups, 1)
    positions = torch.arange(k.shape[2], device=q.device)
    mask = positions[None, :] < ctx_lens[:, None]  # [B, S]
    if window is not None:
        mask &= positions[None, :] >= ctx_lens[:, None] - window
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0, :]


def prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, scale: float,
                   window: int | None = None) -> torch.Tensor:
    """Packed causal prefill with torch's flash-attention `varlen_attn` (CUDA, fp16/bf16); a sliding window W
    is flash-attention's window_size=(W - 1, 0) (W - 1 keys to the left plus the query's own)."""
    params = inspect.signature(varlen_attn).parameters
    kwargs: dict = {}
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-9:
        raise NotImplementedError("this torch's varlen_attn has no scale argument")
    if "window_size" in params:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is not None:
        raise NotImplementedError("this torch's varlen_attn has no window_size argument")
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    k, v = grouped_kv(q, k, v, kwargs)  # as they are where the kernel takes them (AttentionOps checked), else expanded
    cu = ctx.cu_seqlens
    assert cu is not None  # set on every prefill context
    out = varlen_attn(q, k, v, cu, cu, ctx.max_seqlen, ctx.max_seqlen, **kwargs)
    assert isinstance(out, torch.Tensor)  # (out, aux) only with return_aux
    return out


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return varlen_attn is not None


class AttentionOps:
    """Chooses the attention implementation once, from the device, dtype and what is installed."""

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int, block_size: int,
                 use_triton: bool | None = None, use_varlen: bool | None = None) -> None:
        self.use_varlen = varlen_available(device, dtype) if use_varlen is None else use_varlen
        if self.use_varlen:
            prepare_flash(device)  # before any graph capture: whether grouped KV heads go to the kernel as they are
        if use_triton is None:
            use_triton = device.type == "cuda" and triton_ops.decode_supported(head_dim, block_size)
        self.use_triton = use_triton
        self.name = f"prefill={'varlen' if self.use_varlen else 'sdpa'} decode={'triton' if use_triton else 'gather'}"

    def prefill(self, q, k, v, ctx: AttnContext, scale: float, k_cache=None, v_cache=None,
                window: int | None = None) -> torch.Tensor:
        """Packed prefill; `window` is the layer's sliding window (None: full causal attention)."""
        out = self._prefill_fresh(q, k, v, ctx, scale, window)
        if ctx.prefix_batch is not None:
            # Continued turns were computed above as if they started at 0 (a little wasted work on a few tokens,
            # which keeps the packed kernel for the rest); redo them over their prefix, all in one batch.
            prefix_sdpa_batched(q, out, k_cache, v_cache, ctx.prefix_batch, scale, window)
        elif ctx.prefix_lens:
            # Sequences with a cached prefix were computed above as if they started at 0 (a little wasted
            # work on a few tokens, which keeps the packed kernel for the rest); redo them over their prefix.
            bounds, tables = ctx.cu_seqlens_host, ctx.prefix_tables
            assert bounds is not None and tables is not None  # set with prefix_lens
            for i, (start, end) in enumerate(itertools.pairwise(bounds)):
                table = tables[i]
                if ctx.prefix_lens[i] and table is not None:
                    out[start:end] = prefix_sdpa(q[start:end], k_cache, v_cache, table,
                                                 ctx.prefix_lens[i], scale, window)
        return out

    def _prefill_fresh(self, q, k, v, ctx: AttnContext, scale: float, window: int | None = None) -> torch.Tensor:
        if self.use_varlen:
            try:
                return prefill_varlen(q, k, v, ctx, scale, window)
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                # varlen_attn is a prototype API whose signature moved between torch releases.
                warnings.warn(f"varlen_attn failed ({exc!r:.200}); using per-sequence SDPA for prefill.", stacklevel=2)
                self.use_varlen = False
                self.name = self.name.replace("prefill=varlen", "prefill=sdpa")
        return prefill_sdpa(q, k, v, ctx, scale, window)

    def decode(self, q, k_cache, v_cache, ctx: AttnContext, scale: float, window: int | None = None) -> torch.Tensor:
        if self.use_triton:
            assert ctx.block_tables is not None and ctx.ctx_lens is not None  # set on every decode context
            return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.ctx_lens, scale, window)
        return decode_gather(q, k_cache, v_cache, ctx, scale, window)

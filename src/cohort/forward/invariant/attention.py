"""Batch-invariant causal attention: one kernel for the engine's paged cache and the trainer's packed rows.

A program computes one query token's attention for one KV head (its GQA group of query heads are the rows of the
tile, padded to 16, as engine/triton_ops' decode kernel does) over one split of its context. The keys are walked
in tiles of ATTN_TILE from absolute position 0 (a sliding window starts at its first tile), with an online
softmax; the context is cut into splits of SPLIT_KEYS keys, a fixed number of keys, not a number of splits chosen
from the batch (engine/triton_ops.decode_splits gives a small decode batch more splits, which changes the sum).
A query whose context fits in one split is normalised by its program; a longer one's splits are folded by a
second kernel in split order, starting from its first split. Nothing depends on the other queries of the launch,
so a token's output is the same:
- in the engine's decode (one token per sequence, keys read through the block tables),
- in the engine's prefill (every prompt token a query, its keys read through its sequence's table once the step's
  K/V are stored: a continued turn over its cached prefix is no special case),
- in the trainer's packed row (keys at the token's segment start + position in the packed K/V),
the only difference between them being where a key's row is loaded from (PAGED).

`attend_paged` and `attend_packed` are the two entry points; `reference` is the plain PyTorch attention the
training forward's backward differentiates (ops.py).
"""

from __future__ import annotations

import itertools

import torch

from cohort.forward.invariant.kernels import INTERPRETED, _precision, triton

if triton is not None:
    import triton.language as tl

ATTN_TILE = 64  # keys per loop step
SPLIT_KEYS = 1024  # keys per split of a query's context (a multiple of ATTN_TILE)
ATTN_WARPS = 4
ATTN_STAGES = 2
NO_WINDOW = 1 << 30


if triton is not None:

    @triton.jit
    def _key_rows(tables_ptr, base, pos, valid, stride_kb, stride_ks, stride_tb, PAGED: tl.constexpr,
                  BLOCK: tl.constexpr):
        """The offsets of keys `pos` of a query: through its row of block tables (PAGED) or from its segment start."""
        if PAGED:
            block = tl.load(tables_ptr + base * stride_tb + pos // BLOCK, mask=valid, other=0).to(tl.int64)
            return block * stride_kb + (pos % BLOCK) * stride_ks
        else:
            return (base + pos) * stride_ks

    @triton.jit
    def _attn_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, base_ptr, pos_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                     scale, window, max_splits, heads,
                     stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_or, stride_oh,
                     PAGED: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr):
        row, kvh, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        n = tl.load(pos_ptr + row).to(tl.int64) + 1  # keys 0 .. position, itself included
        base = tl.load(base_ptr + row).to(tl.int64)
        lo = tl.maximum(n - window, 0)
        first_split = lo // SPLIT
        last_split = (n - 1) // SPLIT
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        toks = tl.arange(0, TILE)
        row_ok = rows < GROUP
        head_ids = kvh * GROUP + rows
        q = tl.load(q_ptr + row * stride_qr + head_ids[:, None] * stride_qh + dims[None, :], mask=row_ok[:, None],
                    other=0.0)
        q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        first = tl.maximum(lo // TILE, split * (SPLIT // TILE))
        last = tl.minimum(tl.cdiv(n, TILE), (split + 1) * (SPLIT // TILE))
        for i in range(first, last):
            pos = i * TILE + toks
            valid = (pos < n) & (pos >= lo)
            offs = _key_rows(tables_ptr, base, pos, valid, stride_kb, stride_ks, stride_tb, PAGED, BLOCK)
            offs = offs[:, None] + kvh * stride_kh + dims[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            p_v = p.to(v_ptr.dtype.element_ty)
            if UPCAST:
                p_v = p_v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=PRECISION)
            m = m_new
        single = first_split == last_split
        if single:
            if split == first_split:
                tl.store(out_ptr + row * stride_or + head_ids[:, None] * stride_oh + dims[None, :],
                         (acc / denom[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        elif (split >= first_split) & (split <= last_split):
            part = (row * heads + head_ids) * max_splits + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, denom, mask=row_ok)

    @triton.jit
    def _fold_kernel(part_acc_ptr, part_ml_ptr, pos_ptr, out_ptr, window, max_splits, heads, stride_or, stride_oh,
                     HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        n = tl.load(pos_ptr + row).to(tl.int64) + 1
        first_split = tl.maximum(n - window, 0) // SPLIT
        last_split = (n - 1) // SPLIT
        if first_split != last_split:
            dims = tl.arange(0, HEAD_DIM)
            base = (row * heads + head) * max_splits
            acc = tl.load(part_acc_ptr + (base + first_split) * HEAD_DIM + dims)
            m = tl.load(part_ml_ptr + (base + first_split) * 2)
            denom = tl.load(part_ml_ptr + (base + first_split) * 2 + 1)
            for s in range(first_split + 1, last_split + 1):
                m_s = tl.load(part_ml_ptr + (base + s) * 2)
                d_s = tl.load(part_ml_ptr + (base + s) * 2 + 1)
                a_s = tl.load(part_acc_ptr + (base + s) * HEAD_DIM + dims)
                m_new = tl.maximum(m, m_s)
                w_old = tl.exp(m - m_new)
                w_new = tl.exp(m_s - m_new)
                acc = acc * w_old + a_s * w_new
                denom = denom * w_old + d_s * w_new
                m = m_new
            tl.store(out_ptr + row * stride_or + head * stride_oh + dims, (acc / denom).to(out_ptr.dtype.element_ty))


def _launch(q, k, v, tables, base, pos, window, scale, max_keys, paged: bool, block: int) -> torch.Tensor:
    rows, heads, dim = q.shape
    kv_heads = k.shape[-2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    if rows == 0:
        return out
    window = int(window or NO_WINDOW)
    splits = max(1, -(-max_keys // SPLIT_KEYS))
    if splits > 1:
        part_acc = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # never written: every query fits in one split
    stride_kb, stride_ks = (k.stride(0), k.stride(1)) if paged else (0, k.stride(0))
    _attn_kernel[(rows, kv_heads, splits)](
        q, k, v, tables, base, pos, out, part_acc, part_ml, float(scale), window, splits, heads,
        q.stride(0), q.stride(1), stride_kb, stride_ks, k.stride(-2), tables.stride(0) if paged else 0,
        out.stride(0), out.stride(1),
        PAGED=paged, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK=block,
        TILE=ATTN_TILE, SPLIT=SPLIT_KEYS, PRECISION=_precision(q.dtype), UPCAST=INTERPRETED, num_warps=ATTN_WARPS,
        num_stages=ATTN_STAGES,
    )
    if splits > 1:
        _fold_kernel[(rows, heads)](part_acc, part_ml, pos, out, window, splits, heads, out.stride(0), out.stride(1),
                                    HEAD_DIM=dim, SPLIT=SPLIT_KEYS, num_warps=1)
    return out


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 table_rows: torch.Tensor, positions: torch.Tensor, scale: float,
                 window: int | None = None) -> torch.Tensor:
    """Engine side. q [R, H, D]; caches [blocks, block_size, Hkv, D] holding every key up to each query's position
    (its own included: store the step's K/V first); tables [S, W] int32; table_rows [R]: each query's row of
    `tables`; positions [R]: each query's position (it sees keys 0..position, the last `window` of them).
    -> [R, H, D]. The launch covers the table width, so it is the same under a CUDA graph."""
    block = k_cache.shape[1]
    return _launch(q, k_cache, v_cache, tables, table_rows, positions, window, scale, tables.shape[1] * block,
                   paged=True, block=block)


def attend_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, positions: torch.Tensor,
                  scale: float, max_len: int, window: int | None = None) -> torch.Tensor:
    """Trainer side. q [T, H, D], k/v [T, Hkv, D] of a packed row; starts [T]: each token's segment start in the
    row, positions [T]: its position in the segment (keys starts + 0 .. starts + position); max_len: the longest
    segment. -> [T, H, D]."""
    return _launch(q, k, v, starts, starts, positions, window, scale, max_len, paged=False, block=1)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], scale: float,
              window: int | None = None) -> torch.Tensor:
    """Causal (windowed) attention per segment of a packed row with SDPA: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].
    The function the trainer's backward differentiates (any correct attention would do)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for a, b in itertools.pairwise(cu):
        qi = q[a:b].transpose(0, 1)
        ki = k[a:b].transpose(0, 1).repeat_interleave(groups, 0)
        vi = v[a:b].transpose(0, 1).repeat_interleave(groups, 0)
        pos = torch.arange(b - a, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if window is not None:
            mask &= pos[None, :] > pos[:, None] - window
        outs.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=1).transpose(0, 1) if outs else q.new_zeros(q.shape)

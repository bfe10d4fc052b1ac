"""Triton kernels of the GPU path: paged decode attention and the one-pass Gumbel-max sampler.

Both are optional: without Triton (CPU, CI) the engine uses the PyTorch versions in attention.py and
sampler.py, which compute the same functions (tests compare them under TRITON_INTERPRET=1).

Decode attention: one program per (sequence, KV head, KV split). The GQA group's query heads are folded
into the rows of one tile (padded to 16, the smallest tl.dot tile), so a ratio of 7 (Qwen2.5) costs nothing
special and every K/V block is read once per KV head. The loop over the split's keys, decode_tile(head_dim) at a time
(a tile may span several cache blocks: each key's row is found through its block's table entry), uses an
online softmax; the trip count comes from ctx_lens on the device, so the kernel can live inside a CUDA graph.
A sliding-window layer passes window=W: the loop starts at the block holding position ctx_len - W and
masks the keys before it (full attention passes 2**30, larger than any context). With several splits
(flash-decoding: a small batch of long contexts would leave most SMs idle) each program writes its
unnormalised output, maximum and denominator, and a second kernel combines the splits.

Sampler: the vocabulary of each row is cut into `splits` slices, one program per (row, slice). A program
walks its slice once, keeping the running logsumexp of logits/T (for the reported logprob) and the running
argmax of logits/T + Gumbel noise (the sample), and writes those four partials; a second kernel, one program
per row, combines the slices. The noise is a hash of (row key, token id), the same function as
sampler.gumbel_noise, so no RNG state and no [B, V] temporaries. Why slices: with one program per row, a
decode batch of 256 rows is two waves of long serial loops on 132 SMs (0.15 ms a step at Qwen's 152k
vocabulary, 10% of the step); sliced, every SM is busy and the pass runs near the memory and SFU limits.
"""

from __future__ import annotations

import torch

from cohort.engine.triton_cdf import cdf_sample
from cohort.engine.triton_noise import _lse_step, _mix32, _row_key, _uniform

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda.libdevice import fast_log2f
except ImportError:  # CPU-only installs
    triton = None
    tl = None

# ln 2, for the kernels (a global a kernel reads must be a constexpr)
LN2 = tl.constexpr(0.6931471805599453) if tl is not None else 0.6931471805599453


def decode_supported(head_dim: int, block_size: int) -> bool:
    pow2 = head_dim & (head_dim - 1) == 0 and block_size & (block_size - 1) == 0
    return triton is not None and pow2 and head_dim >= 16 and block_size >= 16


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr, part_acc_ptr, part_ml_ptr, scale, window,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
        PRECISION: tl.constexpr, SPLITS: tl.constexpr, TILE: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx_len = tl.load(ctx_ptr + seq)
        rows = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM)
        toks = tl.arange(0, TILE)
        row_ok = rows < GROUP
        heads = kvh * GROUP + rows
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        lo = tl.maximum(ctx_len - window, 0)
        # this program's share of the sequence's live tiles of TILE tokens, [lo, ctx_len) cut into SPLITS equal
        # runs (all of them when SPLITS == 1): a context far shorter than the table (max_model_len) still spreads
        # over every split. A tile spans TILE // BLOCK cache blocks, each token's row found through its block's
        # table entry.
        start = lo // TILE
        end = tl.cdiv(ctx_len, TILE)
        per = tl.cdiv(end - start, SPLITS)
        first = start + split * per
        last = tl.minimum(end, first + per)
        for i in range(first, last):
            pos = i * TILE + toks
            valid = (pos < ctx_len) & (pos >= lo)
            block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK, mask=valid, other=0).to(tl.int64)
            offs = block[:, None] * stride_kb + (pos % BLOCK)[:, None] * stride_ks + kvh * stride_kh + dims[None, :]
            k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [GROUP_PAD, TILE] fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # a row with nothing seen yet (m_new = -inf) keeps zeros rather than exp(-inf - -inf) = NaN
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if SPLITS == 1:
            out = acc / denom[:, None]
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            # unnormalised partials of this split: acc [B, H, S, D], (max, denominator) [B, H, S, 2]
            part = (seq * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, denom, mask=row_ok)

    @triton.jit
    def _paged_decode_combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
                                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        base = (seq * HEADS + head) * SPLITS + parts
        m = tl.load(part_ml_ptr + base * 2)
        denom = tl.load(part_ml_ptr + base * 2 + 1)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # an empty split weighs nothing
        acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + dims[None, :])
        out = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _sample_partial_kernel(
        logits_ptr, choice_ptr, inv_temp_ptr, noise_ptr, seeds_ptr, pos_ptr,
        part_m_ptr, part_s_ptr, part_best_ptr, part_idx_ptr,
        vocab, stride_l, stride_c, SPAN: tl.constexpr, SPLITS: tl.constexpr, BLOCK_V: tl.constexpr,
        FAST_LOG: tl.constexpr, CHOICE_IS_LOGITS: tl.constexpr,
    ):
        row = tl.program_id(0)
        part = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        noise = tl.load(noise_ptr + row)
        key = _row_key(tl.load(seeds_ptr + row), tl.load(pos_ptr + row))
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK_V], tl.int32)
        cols = tl.arange(0, BLOCK_V)
        lo = part * SPAN
        hi = tl.minimum(lo + SPAN, vocab)
        for start in range(0, SPAN, BLOCK_V):
            idx = lo + start + cols
            ok = idx < hi
            x = tl.load(logits_ptr + row * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            if CHOICE_IS_LOGITS:  # no filters (the decode loop's rows): the same values, one load
                c = x
            else:
                c = tl.load(choice_ptr + row * stride_c + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            h = _mix32(key + idx.to(tl.uint32) * 0x61C88647)
            u = _uniform(h)
            if FAST_LOG:  # the hardware's approximate log2 (the accurate log is ~20 instructions, twice here)
                score = c - noise * (fast_log2f(-fast_log2f(u) * LN2) * LN2)
            else:
                score = c - noise * tl.log(-tl.log(u))
            # lane-wise running max / logsumexp / argmax; lanes are combined after the loop
            m, s, _ = _lse_step(x, m, s)
            better = score > best
            best = tl.where(better, score, best)
            best_idx = tl.where(better, idx, best_idx)
        part_max = tl.max(m, 0)
        safe_max = tl.where(part_max == float("-inf"), 0.0, part_max)
        top = tl.max(best, 0)
        out = row * SPLITS + part
        tl.store(part_m_ptr + out, part_max)
        tl.store(part_s_ptr + out, tl.sum(s * tl.exp(m - safe_max), 0))
        tl.store(part_best_ptr + out, top)
        # Ties: the smallest token id wins, like torch.argmax.
        tl.store(part_idx_ptr + out, tl.min(tl.where(best == top, best_idx, vocab), 0))

    @triton.jit
    def _sample_combine_kernel(
        logits_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_best_ptr, part_idx_ptr, tok_ptr, lp_ptr,
        vocab, stride_l, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    ):
        row = tl.program_id(0)
        parts = tl.arange(0, SPLITS_PAD)
        ok = parts < SPLITS
        base = row * SPLITS + parts
        m = tl.load(part_m_ptr + base, mask=ok, other=float("-inf"))
        s = tl.load(part_s_ptr + base, mask=ok, other=0.0)
        best = tl.load(part_best_ptr + base, mask=ok, other=float("-inf"))
        idx = tl.load(part_idx_ptr + base, mask=ok, other=vocab)
        row_max = tl.max(m, 0)
        total = tl.sum(s * tl.exp(m - row_max), 0)  # an empty slice has s = 0 (and m = -inf)
        top = tl.max(best, 0)
        tok = tl.min(tl.where(best == top, idx, vocab), 0)
        chosen = tl.load(logits_ptr + row * stride_l + tok).to(tl.float32) * tl.load(inv_temp_ptr + row)
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, chosen - row_max - tl.log(total))


def decode_splits(batch: int, kv_heads: int, max_blocks: int) -> int:
    """KV splits per (sequence, KV head) for decode attention (flash-decoding): a power of two giving about
    512 programs, at most 16 and at most the blocks a sequence can have. One program per (sequence, KV
    head) leaves most SMs idle once the batch is small and the contexts long (a mixed workload's tail:
    16 sequences of 2,000 tokens, 31.7 us a layer unsplit, 8.6 us in 16 splits on an H100); at 512 programs
    and more, splitting costs more than it gains (256 x 2 programs at 1,024 tokens: 31.1 us unsplit, 41.0 us
    in 2 splits)."""
    want = min(16, max(1, -(-512 // max(batch * kv_heads, 1))), max(1, max_blocks))
    return 1 << (want.bit_length() - 1)


DECODE_WARPS = 4


def decode_tile(head_dim: int) -> tuple[int, int]:
    """(keys per loop iteration, pipeline stages) of the decode kernel for a head size. Measured on an H100
    (bench/engine_profile.py's attention sweep, 14 query / 2 KV heads of 64): 128 keys in 4 stages against
    64 in 3, 256 sequences at 384 tokens 15.0 -> 11.7 us a layer, 128 at 1,024 tokens 36.9 -> 32.7, 64 at
    1,536 tokens 23.1 -> 20.4, equal at 260 tokens and on the 16-sequence tail. Heads of 128 (12 query / 2 KV,
    Qwen2.5-1.5B): 64 keys in 2 stages against 3, 256 sequences at 260 tokens 26.3 -> 17.9 us, at 384 39.0 ->
    34.3, at 1,024 103.9 -> 89.6, within 3% on smaller batches (128 keys of 128 dims in 4 stages would need
    256 KB of shared memory)."""
    return (128, 4) if head_dim <= 64 else (64, 2)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, ctx_lens: torch.Tensor, scale: float,
                           window: int | None = None, splits: int | None = None, tile: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, block_size, Hkv, D]; returns [B, H, D]. window: sliding window or None.
    splits: KV splits per sequence (default decode_splits; 1 = one program per (sequence, KV head)).
    tile: keys per loop iteration, a power of two (default from decode_tile; it may span several cache blocks
    or part of one); num_warps / num_stages: the launch's (defaults DECODE_WARPS and decode_tile's)."""
    batch, heads, head_dim = q.shape
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    width = block_tables.shape[1]
    splits = splits or decode_splits(batch, kv_heads, width)
    if splits & (splits - 1):
        raise ValueError(f"splits={splits} must be a power of two")
    default_tile, default_stages = decode_tile(head_dim)
    tile = tile or default_tile
    if tile & (tile - 1) or tile < 16:
        raise ValueError(f"tile={tile} must be a power of two >= 16")
    if splits > 1:
        part_acc = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, ctx_lens, out, part_acc, part_ml, scale, int(window or 1 << 30),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK=block,
        # float32 models get exact float32 products (not tf32), so they match the PyTorch reference.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLITS=splits, TILE=tile,
        num_warps=num_warps or DECODE_WARPS, num_stages=num_stages or default_stages,
    )
    if splits > 1:
        _paged_decode_combine_kernel[(batch, heads)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                                     HEADS=heads, HEAD_DIM=head_dim, SPLITS=splits, num_warps=1)
    return out


def sample_splits(rows: int, vocab: int, block_v: int = 1024) -> int:
    """Slices per row for the sampler: a power of two (each count compiles its own kernel) giving about 2,048
    programs in all (16 per SM on an H100: every SM busy for a few waves), at most 64, and never more slices
    than blocks of the vocabulary."""
    want = min(64, -(-2048 // max(rows, 1)), -(-vocab // block_v))
    return 1 << max(0, want.bit_length() - 1)


# The pass fused_sample uses where the sampled row is the logits themselves (no filters): "gumbel" (the
# Gumbel-max pass above) or "cdf" (triton_cdf: one uniform per row and the inverse CDF, about half the
# instructions per token in SASS compiled for sm_90; other draws than Gumbel's). "gumbel" until an A/B on a GPU
# (`bench/engine_ab.py --sampler-cdf`) shows "cdf" faster; the engine's CUDA graphs capture the one set.
SAMPLER_PASS = "gumbel"
SAMPLER_PASSES = ("gumbel", "cdf")
# The Gumbel pass reads a row once when the sampled values are the logits themselves (no filters); False reads
# them twice as the filtered case does (bench/engine_ab.py --sampler-load's A/B).
SAMPLER_ONE_LOAD = True


def fused_sample(logits: torch.Tensor, choice: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor, *, splits: int | None = None,
                 block_v: int = 1024, num_warps: int = 4,
                 fast_log: bool | None = None, method: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sample of `choice`/T and log_softmax(logits/T)[token], one pass. Rows: [B, V].

    seeds, positions: int64 [B]; the noise key of a row is sampler.row_key(seed, position). splits: vocabulary
    slices per row (default sample_splits); block_v / num_warps: the slice kernel's tile (bench knobs).
    fast_log: the Gumbel noise through the hardware's approximate log2 (default on a GPU; the interpreter
    has no such instruction): draws differ from the accurate log's only on near-exact ties of two scores.
    method: "gumbel", or "cdf" (only for choice=logits, no filters: the inverse-CDF draw of triton_cdf, one
    uniform per row; other draws than Gumbel's). None: SAMPLER_PASS where choice is logits, else "gumbel".
    """
    if method is None:
        method = SAMPLER_PASS if choice is logits else "gumbel"
    if method not in SAMPLER_PASSES:
        raise ValueError(f"fused_sample(method={method!r}): choose one of {', '.join(SAMPLER_PASSES)}")
    if method != "gumbel" and choice is not logits:
        raise ValueError(f"fused_sample(method={method!r}) samples the logits themselves: pass choice=logits")
    if fast_log is None:
        fast_log = logits.device.type == "cuda"
    rows, vocab = logits.shape
    splits = splits or sample_splits(rows, vocab, block_v)
    # each slice a whole number of blocks, so only a slice's last block is masked
    span = -(-vocab // (splits * block_v)) * block_v
    splits = -(-vocab // span)
    if method == "cdf":
        return cdf_sample(logits, inv_temp, noise, seeds, positions, splits=splits, span=span, block_v=block_v,
                          num_warps=num_warps)
    dev = logits.device
    part_m = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    part_s = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    part_best = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _sample_partial_kernel[(rows, splits)](
        logits, choice, inv_temp, noise, seeds, positions, part_m, part_s, part_best, part_idx,
        vocab, logits.stride(0), choice.stride(0), SPAN=span, SPLITS=splits, BLOCK_V=block_v,
        FAST_LOG=fast_log, CHOICE_IS_LOGITS=choice is logits and SAMPLER_ONE_LOAD, num_warps=num_warps,
    )
    _sample_combine_kernel[(rows,)](
        logits, inv_temp, part_m, part_s, part_best, part_idx, tokens, logprobs, vocab, logits.stride(0),
        SPLITS=splits, SPLITS_PAD=max(2, triton.next_power_of_2(splits)), num_warps=1,
    )
    return tokens, logprobs

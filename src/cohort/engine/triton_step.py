"""The multi-step decode loop's bookkeeping between forwards, as one kernel per step.

Between two forwards of a multi-step launch (engine/multi_step.py) each row records its sampled token and
logprob, feeds the token to the next forward if it is still within its budget, advances its position and
context length, and gets the KV slot of the fed token (from its block table; rows past their budget write to
the scratch block) and the context length its attention sees (1 once past its budget). Written as PyTorch
operations that is about twenty kernels of 1-2 us each per step, ~3% of a 0.5B decode step of 256 rows
(~1.7 ms), most of it launch latency inside the graph; here it is one single-program kernel per step.

`decode_step_torch` is the same function in PyTorch: the CPU path, and the reference the kernel is tested
against (tests/unit/test_triton_step.py, under TRITON_INTERPRET=1).

Layout: `rows` is the runner's [6, max_num_seqs] int64 state (ids, positions, slots, context lengths, seeds,
budgets), `tables` its [max_num_seqs, max_blocks_per_seq] int32 block tables, `attn_ctx` the int32 context
lengths the attention reads.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

IDS, POS, SLOTS, CTX, SEEDS, BUDGET = range(6)

# Whether GPU engines use the kernel (read when a multi-step graph is captured); False gives the PyTorch
# operations, for bench/engine_ab.py --step-kernel's A/B.
USE_KERNEL = True

if triton is not None:
    # the rows' indices as the kernel sees them (a kernel reads globals only as constexprs)
    _IDS, _POS, _SLOTS, _CTX, _BUDGET = (tl.constexpr(i) for i in (IDS, POS, SLOTS, CTX, BUDGET))

    # The step numbers and the row count vary between calls: unspecialised, so no call compiles a variant
    # of its own in the middle of a generation.
    @triton.jit(do_not_specialize=["n", "step", "prep_step"])
    def _decode_step_kernel(
        rows_ptr, stride_rows, tables_ptr, stride_tables, attn_ctx_ptr,
        tokens_ptr, logprobs_ptr, out_tokens_ptr, out_logprobs_ptr,
        n, step, prep_step, block, width, scratch_slot,
        ADVANCE: tl.constexpr, PREPARE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < n
        ctx = tl.load(rows_ptr + _CTX * stride_rows + offs, mask=ok, other=1)
        budget = tl.load(rows_ptr + _BUDGET * stride_rows + offs, mask=ok, other=0)
        if ADVANCE:
            active = budget > step
            tok = tl.load(tokens_ptr + offs, mask=ok, other=0)
            tl.store(out_tokens_ptr + offs, tok, mask=ok)
            tl.store(out_logprobs_ptr + offs, tl.load(logprobs_ptr + offs, mask=ok, other=0.0), mask=ok)
            ids = tl.load(rows_ptr + _IDS * stride_rows + offs, mask=ok, other=0)
            tl.store(rows_ptr + _IDS * stride_rows + offs, tl.where(active, tok, ids), mask=ok)
            advance = active.to(tl.int64)
            pos = tl.load(rows_ptr + _POS * stride_rows + offs, mask=ok, other=0)
            tl.store(rows_ptr + _POS * stride_rows + offs, pos + advance, mask=ok)
            ctx = ctx + advance
            tl.store(rows_ptr + _CTX * stride_rows + offs, ctx, mask=ok)
        if PREPARE:
            active = budget > prep_step
            kv_pos = ctx - 1  # the fed token's position (context lengths are >= 1)
            index = tl.minimum(kv_pos // block, width - 1)
            blk = tl.load(tables_ptr + offs * stride_tables + index, mask=ok, other=0).to(tl.int64)
            slot = blk * block + kv_pos % block
            tl.store(rows_ptr + _SLOTS * stride_rows + offs, tl.where(active, slot, scratch_slot), mask=ok)
            tl.store(attn_ctx_ptr + offs, tl.where(active, ctx, 1).to(tl.int32), mask=ok)


def decode_step_torch(rows: torch.Tensor, tables: torch.Tensor, attn_ctx: torch.Tensor, *, n: int, block: int,
                      scratch_slot: int, advance: tuple | None, prep_step: int | None) -> None:
    """In place on the first n rows. advance: (step, tokens, logprobs, out_tokens, out_logprobs): record the
    step's samples in the out rows and advance the rows within their budget (budget > step). prep_step: then
    set the slots and attention context lengths for that step's forward."""
    ids, pos, slots, ctx, budget = rows[IDS, :n], rows[POS, :n], rows[SLOTS, :n], rows[CTX, :n], rows[BUDGET, :n]
    if advance is not None:
        step, tokens, logprobs, out_tokens, out_logprobs = advance
        out_tokens.copy_(tokens)
        out_logprobs.copy_(logprobs)
        active = budget > step
        ids.copy_(torch.where(active, tokens, ids))
        moved = active.long()
        pos.add_(moved)
        ctx.add_(moved)
    if prep_step is not None:
        active = budget > prep_step
        kv_pos = ctx - 1
        index = (kv_pos // block).clamp_(0, tables.shape[1] - 1)
        slot = tables[:n].gather(1, index[:, None])[:, 0].long() * block + kv_pos % block
        slots.copy_(torch.where(active, slot, scratch_slot))
        # Attention of a row past its budget is computed in vain: it sees one position (its first block's
        # first slot), not its whole context.
        attn_ctx[:n].copy_(torch.where(active, ctx, torch.ones_like(ctx)))


def decode_step(rows: torch.Tensor, tables: torch.Tensor, attn_ctx: torch.Tensor, *, n: int, block: int,
                scratch_slot: int, advance: tuple | None, prep_step: int | None, use_triton: bool) -> None:
    """decode_step_torch's function: one Triton kernel when use_triton, else the PyTorch operations."""
    if not use_triton:
        decode_step_torch(rows, tables, attn_ctx, n=n, block=block, scratch_slot=scratch_slot, advance=advance,
                          prep_step=prep_step)
        return
    if advance is None:
        step, tokens, logprobs, out_tokens, out_logprobs = 0, attn_ctx, attn_ctx, attn_ctx, attn_ctx  # unread
    else:
        step, tokens, logprobs, out_tokens, out_logprobs = advance
    block_n = min(1024, max(16, triton.next_power_of_2(n)))
    _decode_step_kernel[(triton.cdiv(n, block_n),)](
        rows, rows.stride(0), tables, tables.stride(0), attn_ctx, tokens, logprobs, out_tokens, out_logprobs,
        n, step, 0 if prep_step is None else prep_step, block, tables.shape[1], scratch_slot,
        ADVANCE=advance is not None, PREPARE=prep_step is not None, BLOCK_N=block_n, num_warps=4,
    )

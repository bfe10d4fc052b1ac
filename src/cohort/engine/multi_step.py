"""Multi-step decode on the ModelRunner: `decode_steps` forwards per launch, launches that chain.

`launch` queues one launch: the host fills the decode inputs (or, chained, only the budgets and block tables:
the rows continue from the device state the previous launch left), replays the multi-step CUDA graph (or runs
`body` eagerly without graphs), queues the copy of the K x B tokens to a pinned host buffer and records an
event; `collect` waits for that event and returns the tokens. Two host buffer sets alternate, so a chained
launch never rewrites a buffer whose copy may still be queued. `body` is the device-side loop a graph
captures: after each forward the sampled tokens are the next inputs, and positions, context lengths and KV
slots (from the block tables) advance; a row past its budget writes to the scratch block.

The functions are ModelRunner methods (`launch_multi`, `collect_multi`, `_multi_step_body`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from cohort.engine import triton_step
from cohort.engine.attention import AttnContext
from cohort.engine.sampler import sample_plain
from cohort.engine.sequence import Sequence
from cohort.engine.triton_ops import fused_sample

if TYPE_CHECKING:
    from cohort.engine.model_runner import ModelRunner


@torch.inference_mode()
def launch(runner: ModelRunner, seqs: list[Sequence], budgets: list[int], chained: bool = False) -> int:
    """Queue `decode_steps` plain-sampling decode steps of `seqs` (row i's first budgets[i] tokens are
    valid; its blocks hold their KV slots: Scheduler.schedule(lookahead) / reserve_ahead) and the copy of
    their tokens to the host; returns the ticket for `collect`. Nothing waits for the device.

    chained: the same rows, in the same order, continue where the previous launch leaves them on the
    device (last token, positions, context lengths), so only the budgets and block tables are sent;
    the previous launch need not have finished (its tokens are read later)."""
    n = len(seqs)
    which = runner._multi_turn = 1 - runner._multi_turn
    graph_bs = next((b for b in sorted(runner.multi_graphs) if b >= n), None)
    rows = graph_bs or n
    host, floats, tables = runner._multi_host[which], runner._multi_float_host[which], runner._multi_tables_host[which]
    if chained:
        host.numpy()[5, :n] = budgets
        host.numpy()[5, n:rows] = 0
        runner._fill_tables(tables.numpy(), seqs)
        tables.numpy()[n:rows, 0] = runner.scratch_block  # padding rows read only the scratch block
        runner._static_rows[5].copy_(host[5], non_blocking=True)
    else:
        runner._fill_decode_inputs(seqs, rows, budgets, which)
        runner._static_rows.copy_(host, non_blocking=True)
        runner._static_floats.copy_(floats, non_blocking=True)
    runner._static_tables.copy_(tables, non_blocking=True)
    if graph_bs is not None:
        runner.multi_graphs[graph_bs].replay()
    else:
        runner._multi_step_body(n, max_ctx_len=max(len(s) + b for s, b in zip(seqs, budgets)) + runner.decode_steps)
    out_tokens, out_logprobs = runner._multi_out[which]
    # Whole buffers (steps x max_num_seqs, a few KB): a copy into the columns [:, :n] of a pinned buffer is
    # not contiguous, so torch stages it through pageable memory and the host waits for this launch to end
    # (measured on workload B: every launch below 256 rows ran unchained, ~2 ms of idle device per launch).
    out_tokens.copy_(runner._multi_tokens, non_blocking=True)
    out_logprobs.copy_(runner._multi_logprobs, non_blocking=True)
    runner.routes.queue_multi(which)  # router replay's rows, to the same host set (when recording)
    if runner.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(runner.device))
        runner._multi_events[which] = event
    return which


def collect(runner: ModelRunner, ticket: int, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """Wait for a launch's tokens: per-row token and logprob lists of length decode_steps."""
    event = runner._multi_events[ticket]
    if event is not None:
        event.synchronize()
    out_tokens, out_logprobs = runner._multi_out[ticket]
    return ([list(t) for t in zip(*out_tokens[:, :n].tolist())],
            [list(lp) for lp in zip(*out_logprobs[:, :n].tolist())])

def body(runner: ModelRunner, bs: int, max_ctx_len: int | None = None) -> None:
    """decode_steps forwards over the static inputs of `bs` rows, advancing them on the device (captured
    as one graph, or run eagerly without graphs). Between forwards, one decode_step (engine/triton_step.py)
    records the samples, feeds them to the rows within their budget and sets the next forward's KV slots."""
    rows, floats, tables = runner._static_rows, runner._static_floats, runner._static_tables
    block = runner.config.block_size
    step = functools.partial(triton_step.decode_step, n=bs, block=block, scratch_slot=runner.scratch_block * block,
                             use_triton=runner.sample_in_graph and triton_step.USE_KERNEL)
    ids, pos, seeds, ctx_lens = rows[0, :bs], rows[1, :bs], rows[4, :bs], rows[3, :bs]
    ctx = AttnContext(is_prefill=False, slot_mapping=rows[2, :bs], block_tables=tables[:bs],
                      ctx_lens=runner._static_ctx_lens[:bs], max_ctx_len=max_ctx_len)
    out = None if runner._graph_logits is None else runner._graph_logits[:bs]
    # the fed token sits at position ctx_len - 1: its slot from the block table; rows past their budget
    # write to the scratch block
    step(rows, tables, runner._static_ctx_lens, advance=None, prep_step=0)
    for j in range(runner.decode_steps):
        logits = runner.net.logits(runner.routes.forward_multi(j, bs, ids, pos, ctx, runner._cache()), out=out)
        if runner.sample_in_graph:
            tokens, logprobs = fused_sample(logits, logits, floats[0, :bs], floats[1, :bs], seeds, ctx_lens)
        else:
            tokens, logprobs = sample_plain(logits, floats[0, :bs], floats[1, :bs], seeds, ctx_lens)
        logprobs = runner.net.sampled_logprobs(logits, tokens, logprobs, floats[0, :bs])  # exact parity's kernel
        # A valid sample is fed next: the state after the last step is where a chained launch resumes.
        last = j == runner.decode_steps - 1
        step(rows, tables, runner._static_ctx_lens,
             advance=(j, tokens, logprobs, runner._multi_tokens[j, :bs], runner._multi_logprobs[j, :bs]),
             prep_step=None if last else j + 1)

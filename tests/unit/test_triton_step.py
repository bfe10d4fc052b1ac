"""engine/triton_step.py: the multi-step decode loop's bookkeeping kernel against its PyTorch twin (the CPU
path) under TRITON_INTERPRET=1, the kernel built for an H100 on the CPU (the interpreter accepts kernels the
compiler refuses), and the twin against values worked out by hand.

The interpreter must be on when the kernel module is first imported, so the kernel runs in a child process:
this file run as a script. Skips without Triton."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import run_interpreted

from cohort.engine.triton_step import decode_step_torch

BLOCK, SCRATCH_BLOCK = 4, 9


def _state(top: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(6, top, dtype=torch.int64)
    rows[0] = torch.randint(0, 1000, (top,), generator=g)  # ids
    rows[1] = torch.randint(0, 50, (top,), generator=g)  # positions
    rows[2] = -7  # slots: overwritten
    rows[3] = torch.randint(1, width * BLOCK, (top,), generator=g)  # context lengths (>= 1)
    rows[4] = torch.randint(0, 2**40, (top,), generator=g)  # seeds: untouched
    rows[5] = torch.randint(0, 4, (top,), generator=g)  # budgets: some rows stop before the steps end
    tables = torch.randint(0, 64, (top, width), generator=g, dtype=torch.int32)
    attn_ctx = torch.full((top,), -3, dtype=torch.int32)
    tokens = torch.randint(0, 1000, (top,), generator=g)
    logprobs = -torch.rand(top, generator=g)
    return rows, tables, attn_ctx, tokens, logprobs


def test_twin_by_hand():
    rows = torch.tensor([[5, 6, 7],      # ids
                         [10, 20, 30],   # positions
                         [0, 0, 0],      # slots
                         [4, 5, 8],      # context lengths
                         [1, 2, 3],      # seeds
                         [2, 1, 0]])     # budgets
    tables = torch.tensor([[3, 4], [5, 6], [7, 8]], dtype=torch.int32)
    attn_ctx = torch.zeros(3, dtype=torch.int32)
    out_tok, out_lp = torch.zeros(3, dtype=torch.long), torch.zeros(3)
    decode_step_torch(rows, tables, attn_ctx, n=3, block=BLOCK, scratch_slot=SCRATCH_BLOCK * BLOCK,
                      advance=(0, torch.tensor([50, 60, 70]), torch.tensor([-1.0, -2.0, -3.0]), out_tok, out_lp),
                      prep_step=1)
    assert out_tok.tolist() == [50, 60, 70] and out_lp.tolist() == [-1.0, -2.0, -3.0]
    # rows 0 and 1 had budget for step 0: fed their token, moved one position; row 2 (budget 0) did not
    assert rows[0].tolist() == [50, 60, 7] and rows[1].tolist() == [11, 21, 30] and rows[3].tolist() == [5, 6, 8]
    # step 1: only row 0 (budget 2) is active; its fed token at position 4 is block 1 of its table (4), offset 0
    assert rows[2].tolist() == [4 * BLOCK + 0, SCRATCH_BLOCK * BLOCK, SCRATCH_BLOCK * BLOCK]
    assert attn_ctx.tolist() == [5, 1, 1]
    assert rows[4].tolist() == [1, 2, 3] and rows[5].tolist() == [2, 1, 0]


def _check_kernel() -> None:
    from cohort.engine import triton_step

    for top, n, width in ((8, 8, 3), (40, 37, 5), (2100, 2050, 4)):  # several programs in the last
        for advance_step, prep_step in ((None, 0), (0, 1), (2, 3), (3, None)):
            args = _state(top, width, seed=top * 10 + (prep_step or 7))
            twin = [t.clone() for t in args]
            outs = [(torch.zeros(top, dtype=torch.long), torch.zeros(top)) for _ in range(2)]
            for use_triton, (rows, tables, attn_ctx, tokens, logprobs), (out_tok, out_lp) in zip(
                    (True, False), (args, twin), outs):
                advance = None if advance_step is None else (advance_step, tokens[:n], logprobs[:n], out_tok[:n],
                                                              out_lp[:n])
                triton_step.decode_step(rows, tables, attn_ctx, n=n, block=BLOCK, scratch_slot=SCRATCH_BLOCK * BLOCK,
                                        advance=advance, prep_step=prep_step, use_triton=use_triton)
            for a, b in zip(args, twin):
                assert torch.equal(a, b), (top, n, advance_step, prep_step)
            assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
            assert (args[0][:, n:] == _state(top, width, seed=top * 10 + (prep_step or 7))[0][:, n:]).all()


@pytest.mark.parametrize("advance, prepare", [(False, True), (True, True), (True, False)])
def test_kernel_builds_for_the_h100(advance, prepare):
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    from tests.helpers.triton_compile import compile_for_h100

    from cohort.engine.triton_step import _decode_step_kernel

    pointers = {"rows_ptr": "*i64", "tables_ptr": "*i32", "attn_ctx_ptr": "*i32", "tokens_ptr": "*i64",
                "logprobs_ptr": "*fp32", "out_tokens_ptr": "*i64", "out_logprobs_ptr": "*fp32"}
    scalars = dict.fromkeys(("stride_rows", "stride_tables", "n", "step", "prep_step", "block", "width",
                             "scratch_slot"), "i32")
    constexprs = {"ADVANCE": advance, "PREPARE": prepare, "BLOCK_N": 256}
    signature = {name: {**pointers, **scalars}.get(name, "constexpr") for name in _decode_step_kernel.arg_names}
    assert "cubin" in compile_for_h100(_decode_step_kernel, signature, constexprs).asm


def test_kernel_equals_the_twin():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    run_interpreted(__file__, "step ok")


if __name__ == "__main__":
    from tests.helpers.triton_interpreter import patch_interpreter_index

    patch_interpreter_index()
    _check_kernel()
    print("step ok")

"""triton_ops.paged_decode_attention against attention.decode_gather (the PyTorch decode path) on the CPU
under TRITON_INTERPRET=1: one program per (sequence, KV head) and flash-decoding splits of the KV blocks
(combined by a second kernel), full and sliding-window attention, GQA ratios 2 and 7, contexts of one token,
a partial last block and every block of the table, loop tiles of one block, several blocks and half a block. The interpreter must be on when triton_ops is first
imported, so the kernels run in a child process (this file as a script).
Skips without Triton (it is not a project dependency; `pip install triton` to run these)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import patch_interpreter_index, run_interpreted


def _check() -> None:
    from cohort.engine import triton_ops
    from cohort.engine.attention import AttnContext, decode_gather

    torch.manual_seed(0)
    for batch, heads, kv_heads, dim, block, width, window in ((3, 4, 2, 16, 16, 8, None), (3, 7, 1, 16, 16, 6, 20)):
        blocks = 40
        q = torch.randn(batch, heads, dim)
        k_cache = torch.randn(blocks, block, kv_heads, dim)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randint(0, blocks, (batch, width), dtype=torch.int32)
        ctx_lens = torch.tensor([1, width * block, 37], dtype=torch.int32)
        ctx = AttnContext(False, None, block_tables=tables, ctx_lens=ctx_lens, max_ctx_len=width * block)
        ref = decode_gather(q, k_cache, v_cache, ctx, 0.125, window)
        for splits in (1, 2, 4, 8):
            for tile in (16, 32, 64, None):  # one block per iteration, tiles spanning 2, 4 and (default) 8 blocks
                out = triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx_lens, 0.125, window,
                                                        splits=splits, tile=tile)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        # a tile smaller than a block (half of one per iteration)
        k32 = torch.randn(blocks, 32, kv_heads, dim)
        v32 = torch.randn_like(k32)
        ctx32 = AttnContext(False, None, block_tables=tables, ctx_lens=ctx_lens * 2, max_ctx_len=width * 64)
        ref32 = decode_gather(q, k32, v32, ctx32, 0.125, window)
        out32 = triton_ops.paged_decode_attention(q, k32, v32, tables, ctx_lens * 2, 0.125, window, tile=16)
        torch.testing.assert_close(out32, ref32, atol=1e-5, rtol=1e-5)


def test_split_kv_decode_attention_equals_the_gather_path():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    run_interpreted(__file__, "attention ok")


def test_default_splits_grow_as_the_batch_shrinks():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    from cohort.engine.triton_ops import decode_splits

    assert decode_splits(256, 2, 128) == 1
    assert decode_splits(128, 2, 128) == 2
    assert decode_splits(64, 2, 128) == 4
    assert decode_splits(1, 2, 128) == 16
    assert decode_splits(512, 8, 128) == 1
    assert decode_splits(1, 2, 3) == 2  # never more splits than blocks per sequence


if __name__ == "__main__":
    patch_interpreter_index()
    _check()
    print("attention ok")

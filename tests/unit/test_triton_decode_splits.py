"""Flash-decoding splits follow the live context, not the table width (issue 33): with the context limit now the
model's own (32k and more in `cohort serve`), a split of the table's positions would leave every split but the
first idle for the short contexts of a small batch. Under TRITON_INTERPRET=1 in a child process (see
tests/helpers/triton_interpreter.py); skips without Triton."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import patch_interpreter_index, run_interpreted


def _check() -> None:
    from cohort.engine import triton_ops
    from cohort.engine.attention import AttnContext, decode_gather

    real, seen = triton_ops._paged_decode_combine_kernel, []

    class Recording:  # the combine kernel, recording the splits' partial maxima
        def __getitem__(self, grid):
            def launch(part_acc, part_ml, *a, **k):
                seen.append(part_ml[..., 0].clone())
                return real[grid](part_acc, part_ml, *a, **k)
            return launch

    triton_ops._paged_decode_combine_kernel = Recording()
    torch.manual_seed(0)
    block, width, blocks = 16, 64, 80  # a table of 1,024 positions
    q = torch.randn(2, 4, 16)
    k_cache, v_cache = torch.randn(blocks, block, 2, 16), torch.randn(blocks, block, 2, 16)
    tables = torch.randint(0, blocks, (2, width), dtype=torch.int32)
    ctx_lens = torch.tensor([37, 1000], dtype=torch.int32)  # 3 tiles of 16, and nearly the whole table
    out = triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx_lens, 0.25, splits=4, tile=16)
    ref = decode_gather(q, k_cache, v_cache, AttnContext(False, None, block_tables=tables, ctx_lens=ctx_lens,
                                                         max_ctx_len=width * block), 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    busy = (seen[0] > float("-inf")).all(dim=1).sum(dim=-1)  # splits that saw keys, per sequence
    assert busy.tolist() == [3, 4], busy  # the 3 tiles of the short context go to 3 splits (a table split: 1)
    # windowed: only the last 40 positions of the long context are live, still spread over the splits
    window = triton_ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx_lens, 0.25, 40, splits=4, tile=16)
    torch.testing.assert_close(window, decode_gather(q, k_cache, v_cache, AttnContext(
        False, None, block_tables=tables, ctx_lens=ctx_lens, max_ctx_len=width * block), 0.25, 40), atol=1e-5,
        rtol=1e-5)
    assert (seen[1][1] > float("-inf")).all(dim=0).sum().item() >= 3


def test_splits_share_the_live_context():
    pytest.importorskip("triton", reason="needs Triton (GPU kernels, run by its CPU interpreter here): pip install triton")
    run_interpreted(__file__, "splits ok")


if __name__ == "__main__":
    patch_interpreter_index()
    _check()
    print("splits ok")

"""The batched prefix attention of continued turns equals the per-turn one (prefix_sdpa), window or not."""

from __future__ import annotations

import pytest
import torch

from cohort.engine.attention import prefix_batch, prefix_sdpa, prefix_sdpa_batched


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("max_elements", [1 << 27, 1])  # one chunk; one turn per chunk
def test_batched_prefix_attention_matches_per_turn(window, max_elements):
    torch.manual_seed(0)
    bs, heads, kv_heads, dim, blocks = 4, 4, 2, 8, 32
    k_cache = torch.randn(blocks, bs, kv_heads, dim)
    v_cache = torch.randn(blocks, bs, kv_heads, dim)
    # a packed step: a fresh prompt of 6 rows, then turns of 3 new tokens after 9 cached and 1 after 2 cached
    turns = [(6, 3, 9), (9, 1, 2)]
    tables = [[7, 3, 11], [5]]
    q = torch.randn(10, heads, dim)
    out = torch.zeros(10, heads, dim)
    batch = prefix_batch(turns, tables, bs, torch.device("cpu"))
    prefix_sdpa_batched(q, out, k_cache, v_cache, batch, scale=0.3, window=window, max_elements=max_elements)
    assert torch.equal(out[:6], torch.zeros(6, heads, dim))  # rows of the fresh prompt are left alone
    for (start, new, cached), table in zip(turns, tables):
        want = prefix_sdpa(q[start:start + new], k_cache, v_cache, torch.tensor(table), cached, 0.3, window)
        torch.testing.assert_close(out[start:start + new], want)

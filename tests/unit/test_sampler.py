"""The engine's Sampler: host-side inputs laid out so the fused Triton kernel never recompiles mid-run."""

from __future__ import annotations

import numpy as np
import torch

from cohort.engine.sampler import Sampler, aligned_rows


def test_stacked_sampler_rows_start_16_byte_aligned_for_every_row_count():
    # Triton compiles once per pointer alignment: the second row of a [2, n] stack must not move classes with n
    for n in range(1, 10):
        for dtype in (np.float32, np.int64):
            rows = [np.arange(n, dtype=dtype), np.arange(n, dtype=dtype) + 7]
            out = aligned_rows(rows, dtype)
            assert out.strides[0] % 16 == 0 and out.shape[1] >= n
            assert (out[0, :n] == rows[0]).all() and (out[1, :n] == rows[1]).all()


def test_sampler_warm_is_a_no_op_without_triton():
    assert Sampler(torch.device("cpu"), use_triton=False).warm(1000, 8, torch.float32) == 0

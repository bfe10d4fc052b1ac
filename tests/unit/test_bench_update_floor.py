"""bench/update_floor.py's arithmetic on the CPU: the bench's 0.5B shapes (parameters, FLOPs, bytes each
elementwise pass must move) and the floor rows, against hand-derived numbers."""

from __future__ import annotations

import pytest
from tests.helpers.bench_modules import load_bench


@pytest.fixture(scope="module")
def floor():
    return load_bench("update_floor.py", "update_floor_bench")


def test_qwen25_05b_parameters(floor):
    # Qwen2.5-0.5B's published count with tied embeddings
    assert floor.qwen2_params(floor.SPEC) == 494_032_768


def test_elementwise_bytes_by_hand(floor):
    t, c, p = 1000, 800, 10
    moved = floor.elementwise_bytes(floor.SPEC, t, c, p)
    assert moved["SiLU-and-multiply"] == 24 * 8 * 1000 * 4864 * 2
    assert moved["norm"] == 49 * 8 * 1000 * 896 * 2
    assert moved["rotary"] == 24 * 4 * 1000 * (896 + 128) * 2
    assert moved["logprob"] == 3 * 800 * 151936 * 2
    assert moved["optimizer"] == 10 * 28


def test_floor_rows(floor):
    flops = 0.5 * floor.PEAK_FLOPS * 0.4  # 50% MFU at 400 ms
    rows = floor.floor_rows(flops=flops, matmul_ms=300.0, pass_gb={"SiLU-and-multiply": 30.0, "optimizer": 3.0},
                            tb_s=3.0, attention_ms=50.0, square_matmul_ms=250.0, step_matmul_ms=290.0,
                            update_ms=500.0)
    assert "| SiLU-and-multiply | 10.0 | 30.0 GB at 3.00 TB/s (copy) |" in rows
    assert "| optimizer | 1.0 | 3.0 GB at 3.00 TB/s (copy) |" in rows
    table = {r.split(" | ")[0][2:]: r.split(" | ")[1:] for r in rows if r.startswith("| ") and "|" in r[2:]}
    assert table["cuBLAS alone, FlashAttention-2"] == ["361.0", "55.4% |"]
    fa4 = 300 + 11 + 50 * floor.FA4_RATIO
    assert table[f"cuBLAS alone, FlashAttention-4 ({floor.FA4_RATIO} x)"][0] == f"{fa4:.1f}"
    assert table["the step's matmuls, q, k, v as one GEMM, FlashAttention-2"][0] == "351.0"
    assert table["every matmul at the square GEMM's rate, FlashAttention-4"][0] == f"{fa4 - 50:.1f}"
    assert table["50% MFU needs"] == ["400.0", "50.0% |"]
    assert table["measured update"] == ["500.0", "40.0% |"]

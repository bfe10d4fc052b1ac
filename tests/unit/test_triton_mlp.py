"""triton_mlp.silu_down (SiLU(gate) * up feeding the down GEMM, split over the reduction, one kernel plus a fixed-
order sum) against F.silu, the product and F.linear, on the CPU under TRITON_INTERPRET=1 (in a child process:
this file run as a script, with the GPU's bfloat16 rounding and bfloat16 products given to the interpreter);
the kernel is also built for an H100 on the CPU. Skips without Triton."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.triton_interpreter import run_interpreted


def _check() -> None:
    import torch.nn.functional as F

    from cohort.engine.triton_mlp import Tiling, silu_down

    g = torch.Generator().manual_seed(0)
    for rows, inter, hidden, tiling in ((1, 256, 48, Tiling(16, 16, 64, 1, 4, 2)),
                                        (37, 384, 80, Tiling(32, 32, 64, 4, 4, 2)),    # splits of uneven share
                                        (130, 512, 64, Tiling(64, 32, 128, 3, 4, 2))):  # several row tiles
        gate_up = torch.randn(rows, 2 * inter, generator=g) * 2
        weight = torch.randn(hidden, inter, generator=g) / inter**0.5
        gate, up = gate_up.chunk(2, dim=-1)
        # float32: the same function up to the summation order
        want = F.linear(F.silu(gate) * up, weight)
        torch.testing.assert_close(silu_down(gate_up, weight, tiling), want, atol=1e-5, rtol=1e-5)
        # bfloat16: SiLU * up rounded to bfloat16 (what the elementwise kernel stores), products summed in float32
        gu, w = gate_up.bfloat16(), weight.bfloat16()
        gate, up = gu.float().chunk(2, dim=-1)
        h = (F.silu(gate) * up).bfloat16().float()
        want = F.linear(h, w.float()).bfloat16()
        got = silu_down(gu, w, tiling)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        # a wrong gate/up order or a missing SiLU is far outside these tolerances
        assert (F.linear(F.silu(up) * gate, w.float()) - want.float()).abs().max() > 0.1


def test_kernel_equals_silu_product_then_linear():
    pytest.importorskip("triton")
    run_interpreted(__file__, "silu down ok")


def test_kernel_builds_for_the_h100():
    pytest.importorskip("triton")
    from tests.helpers.triton_compile import compile_for_h100

    from cohort.engine.triton_mlp import _silu_down_kernel

    constexprs = {"PRECISION": "tf32", "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4}
    pointers = {"gu_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32"}
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32")
                 for name in _silu_down_kernel.arg_names}
    assert "cubin" in compile_for_h100(_silu_down_kernel, signature, constexprs).asm


def test_rejects_shapes_and_switch(monkeypatch):
    pytest.importorskip("triton")
    from cohort.engine import triton_mlp

    with pytest.raises(ValueError, match="silu_down"):
        triton_mlp.silu_down(torch.zeros(2, 100), torch.zeros(8, 64))
    cuda = torch.device("cuda")
    assert not triton_mlp.fused_silu_down_supported(torch.device("cpu"), 4864)
    assert not triton_mlp.fused_silu_down_supported(cuda, 4800)
    assert triton_mlp.fused_silu_down_supported(cuda, 4864)
    monkeypatch.setenv(triton_mlp.ENV_SWITCH, "0")
    assert not triton_mlp.fused_silu_down_supported(cuda, 4864)


if __name__ == "__main__":
    from tests.helpers.triton_interpreter import patch_interpreter_bf16_rounding, patch_interpreter_index

    patch_interpreter_index()
    patch_interpreter_bf16_rounding()
    _check()
    print("silu down ok")

"""The engine's torch.compile'd elementwise ops (models/layers.py, models/gemma3.py) compile once per dtype, rank,
last-dimension width and size-1 pattern of the leading dimensions, whatever the batch size, head count or
requires_grad of the weights; the width stays static (a symbolic width made the norms looped reductions, 20%
slower decode on the GPU).

On the GPU, graph capture calls them at batch sizes 16, 8, 4, 2, 1 for the hidden norm and the q/k head norms
(Gemma 3 has one KV head), and a test session runs float32 and bf16 models of several widths in one process:
a plain torch.compile(dynamic=True) also specialised on requires_grad and exceeded dynamo's default recompile
limit of 8 (FailOnRecompileLimitHit under fullgraph); layers.RECOMPILE_LIMIT raises it. Here the compiles are counted on the CPU with
a counting backend (the guards are dynamo's, independent of the backend) and the values checked against the
plain functions.
"""

from __future__ import annotations

import torch

from cohort.engine.models.gemma3 import gemma_residual, gemma_rms_norm
from cohort.engine.models.layers import add_rms_norm, compile_shape_generic, rms_norm, rope


class _Counting:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def _weight(width: int, dtype, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(width, dtype=dtype), requires_grad=requires_grad)


def _norm_cases():
    """(x, weight) over the shapes the engine passes: [T, hidden] and [T, heads, head_dim], T and heads 1 or more."""
    for dtype in (torch.float32, torch.bfloat16):
        for requires_grad in (True, False):
            for width in (16, 64, 96):
                for rows in (16, 8, 4, 2, 1, 7):
                    yield torch.randn(rows, width, dtype=dtype), _weight(width, dtype, requires_grad)
                    for heads in (4, 1):
                        yield torch.randn(rows, heads, width, dtype=dtype), _weight(width, dtype, requires_grad)


def _graph_key(x: torch.Tensor) -> tuple:
    """What a compiled op may specialise on: dtype, rank, the (static) last dim, which leading dims are 1."""
    return x.dtype, x.dim(), x.shape[-1], tuple(size == 1 for size in x.shape[:-1])


def test_norms_compile_once_per_dtype_rank_and_width():
    torch._dynamo.reset()
    for plain, weights in ((rms_norm, (1,)), (gemma_rms_norm, (1,))):
        backend = _Counting()
        compiled = compile_shape_generic(plain, weights=weights, backend=backend)
        keys = set()
        for x, w in _norm_cases():
            with torch.inference_mode():
                torch.testing.assert_close(compiled(x, w, 1e-6), plain(x, w, 1e-6))
            keys.add(_graph_key(x))
        # 6 row counts (5 of them > 1) and requires_grad change nothing: 36 graphs for 216 calls
        assert backend.graphs == len(keys) == 36, (plain.__name__, backend.graphs)


def test_width_stays_static():
    """The last dim is a constant in the compiled graph (no symbol): the kernels know their reduction width."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs])
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.dim():
                assert isinstance(value.shape[-1], int), (node, value.shape)
        return gm.forward

    compiled = compile_shape_generic(rms_norm, weights=(1,), backend=backend)
    for rows in (8, 4, 2):
        compiled(torch.randn(rows, 32), _weight(32, torch.float32, False), 1e-6)
    assert len(seen) == 1


def test_residual_norms_and_rope_compile_once_per_dtype_and_width():
    torch._dynamo.reset()
    add, gemma, rot = _Counting(), _Counting(), _Counting()
    norm_keys, rope_keys = set(), set()
    c_add = compile_shape_generic(add_rms_norm, weights=(2,), backend=add)
    c_gemma = compile_shape_generic(gemma_residual, weights=(2, 3), backend=gemma)
    c_rope = compile_shape_generic(rope, backend=rot)
    for dtype in (torch.float32, torch.bfloat16):
        for width, heads, kv_heads, dim in ((64, 4, 1, 16), (96, 4, 2, 24), (32, 2, 2, 16)):
            for rows in (16, 4, 2, 1):
                norm_keys.add((dtype, width, rows == 1))
                rope_keys.add((dtype, dim, rows == 1, heads == 1, kv_heads == 1))
                x, delta = torch.randn(rows, width, dtype=dtype), torch.randn(rows, width, dtype=dtype)
                w1, w2 = _weight(width, dtype, True), _weight(width, dtype, False)
                for got, want in zip(c_add(x, delta, w1, 1e-6), add_rms_norm(x, delta, w1, 1e-6)):
                    torch.testing.assert_close(got, want)
                for got, want in zip(c_gemma(x, delta, w1, w2, 1e-6), gemma_residual(x, delta, w1, w2, 1e-6)):
                    torch.testing.assert_close(got, want)
                q, k = torch.randn(rows, heads, dim, dtype=dtype), torch.randn(rows, kv_heads, dim, dtype=dtype)
                cos, sin = torch.randn(rows, dim, dtype=dtype), torch.randn(rows, dim, dtype=dtype)
                for got, want in zip(c_rope(q, k, cos, sin), rope(q, k, cos, sin)):
                    torch.testing.assert_close(got, want)
    assert (add.graphs, gemma.graphs, rot.graphs) == (len(norm_keys), len(norm_keys), len(rope_keys))

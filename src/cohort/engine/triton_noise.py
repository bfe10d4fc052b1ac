"""Triton device functions shared by the sampling kernels (`triton_ops`, `triton_cdf`): the noise hash, the
row key, the uniform in (0, 1) and one step of an online log-sum-exp. The same bits as `noise.py` on the host.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

if triton is not None:
    @triton.jit
    def _mix32(x):
        # lowbias32 (C. Wellons): a strong 32-bit integer hash; uint32 arithmetic wraps like the torch
        # version's int64 arithmetic masked to 32 bits.
        x = x ^ (x >> 16)
        x = x * 0x21F0AAAD
        x = x ^ (x >> 15)
        x = x * 0x735A2D97
        x = x ^ (x >> 15)
        return x

    @triton.jit
    def _row_key(seed, pos):
        """sampler.row_key(seed, position) of int64 scalars, on the device (so a sampler sits in a CUDA graph)."""
        key = _mix32(((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32(key ^ (seed & 0xFFFFFFFF).to(tl.uint32))
        return _mix32(key ^ (pos & 0xFFFFFFFF).to(tl.uint32))

    @triton.jit
    def _uniform(h):
        """sampler.uniform_from_hash: the top 23 bits of a uint32 hash, centred, strictly inside (0, 1)."""
        return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def _lse_step(x, m, s):
        """One step of the lane-wise running max `m` and sum `s` of exp(x - m): one exp per element,
        exp(-|x - m|) rescaling whichever of the running sum and the new term is smaller; -inf (masked lanes,
        -inf logits) adds nothing. Returns (new max, new sum, whether x is a new max)."""
        bigger = x > m
        e = tl.exp(tl.where(bigger, m - x, x - m))
        e = tl.where(x == float("-inf"), 0.0, e)
        return tl.maximum(m, x), tl.where(bigger, s * e + 1.0, s + e), bigger
else:  # CPU-only installs: the names exist, so the kernel modules import; nothing calls them without Triton
    _mix32 = _row_key = _uniform = _lse_step = None

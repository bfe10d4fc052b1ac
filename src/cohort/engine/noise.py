"""The sampler's counter-based noise: a 32-bit hash of (seed, position, token) and the uniform it gives.

The same bits on the host, in torch and in the Triton kernels (`triton_ops`, `triton_cdf`), so a request's
samples depend only on its seed, never on its batch.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def mix32(x):
    """lowbias32 hash of uint32 values held in a Python int, an int64 numpy array or an int64 tensor (the
    multipliers are below 2**31, so nothing overflows int64); the same bits as the Triton kernel's."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """float32 u strictly inside (0, 1) from 32-bit hashes: the top 23 bits, centred in their bin.

    23 bits, not 24: (2**24 - 1 + 0.5) / 2**24 rounds to exactly 1.0 in float32, whose Gumbel noise
    -log(-log(1)) is +inf (a NaN score when greedy multiplies it by 0); about 1.5% of rows of a 262k
    vocabulary held such a token. (2**23 - 0.5) / 2**23 = 1 - 2**-24 is exact in float32."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)

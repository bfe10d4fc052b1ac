"""Sampling by the inverse CDF with one random number per row: the sampler pass without per-token noise.

The Gumbel-max pass (`triton_ops.fused_sample`) hashes and takes two logarithms for every token of the
vocabulary: on an H100 its slice kernel is bound by instruction issue (~1.7 warp instructions per token, about
76 us a decode step at 256 rows x 152k tokens), not by the 78 MB it reads. Sampling from softmax(x / T) only
needs one uniform u per row: the token is the first whose cumulative probability passes u.

- `_cdf_stats_kernel`, one program per (row, slice): the slice's max of x / T, its sum of exp(x / T - max)
  and its first argmax (greedy rows), in one read and one exp per token.
- `_cdf_pick_kernel`, one program per row: the row's logsumexp from the slices; the slice whose cumulative
  mass first passes u x total; then, inside that slice only (1/splits of the row), the first token whose
  running sum of exp(x / T - slice max) passes the rest. Greedy rows take the argmax. The logprob is
  log_softmax(x / T)[token], as the Gumbel pass reports it.

u comes from the row key (sampler.row_key(seed, position)) through the same hash, so draws need no RNG state
and do not depend on the batch. u has 23 bits, so a token's chance is resolved to about 1.2e-7 of the row's
mass (a token rarer than that is drawn with probability 0 or ~1.2e-7, depending on where its interval falls),
the same order as the float32 rounding of the Gumbel pass's scores. The draws are not the Gumbel pass's (a
different function of u), so the engine uses this pass only where `triton_ops.SAMPLER_PASS` says so, and only
for rows without filters.
`cdf_sample_reference` is the same draw in float64 PyTorch (tests).
"""

from __future__ import annotations

import torch

from cohort.engine.noise import mix32, uniform_from_hash
from cohort.engine.triton_noise import _lse_step, _mix32, _row_key, _uniform

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None

# mixed into the row key before hashing it to the row's uniform (the Gumbel pass hashes key + token id)
ROW_SALT = 0x2545F491


def cdf_sample_reference(logits: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor,
                         keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs) of the inverse-CDF draw in float64: the first token whose cumulative probability
    exceeds the row's uniform; greedy rows (noise 0) the argmax. keys: int64 row keys."""
    scaled = logits.double() * inv_temp.double()[:, None]
    logp = scaled - torch.logsumexp(scaled, -1, keepdim=True)
    cdf = torch.cumsum(logp.exp(), -1)
    u = uniform_from_hash(mix32((keys ^ ROW_SALT) & 0xFFFFFFFF)).double()
    sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=logits.shape[1] - 1)
    tokens = torch.where(noise > 0, sampled, scaled.argmax(-1))
    return tokens, logp.gather(-1, tokens[:, None])[:, 0].float()


if triton is not None:
    @triton.jit
    def _cdf_stats_kernel(logits_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_idx_ptr, vocab, stride_l,
                          SPAN: tl.constexpr, SPLITS: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        inv_t = tl.load(inv_temp_ptr + row)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)
        arg = tl.zeros([BLOCK_V], tl.int32)
        cols = tl.arange(0, BLOCK_V)
        lo = part * SPAN
        hi = tl.minimum(lo + SPAN, vocab)
        for start in range(0, SPAN, BLOCK_V):
            idx = lo + start + cols
            x = tl.load(logits_ptr + row * stride_l + idx, mask=idx < hi, other=float("-inf")).to(tl.float32) * inv_t
            m, s, bigger = _lse_step(x, m, s)
            arg = tl.where(bigger, idx, arg)  # strict: a lane keeps its first maximum
        part_max = tl.max(m, 0)
        safe_max = tl.where(part_max == float("-inf"), 0.0, part_max)
        out = row * SPLITS + part
        tl.store(part_m_ptr + out, part_max)
        tl.store(part_s_ptr + out, tl.sum(s * tl.exp(m - safe_max), 0))
        tl.store(part_idx_ptr + out, tl.min(tl.where(m == part_max, arg, vocab), 0))  # ties: the smallest id

    @triton.jit
    def _cdf_pick_kernel(logits_ptr, inv_temp_ptr, noise_ptr, seeds_ptr, pos_ptr, part_m_ptr, part_s_ptr,
                         part_idx_ptr, tok_ptr, lp_ptr, vocab, stride_l, SPAN: tl.constexpr, SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, BLOCK_V: tl.constexpr, SALT: tl.constexpr):
        row = tl.program_id(0)
        parts = tl.arange(0, SPLITS_PAD)
        ok = parts < SPLITS
        base = row * SPLITS + parts
        m = tl.load(part_m_ptr + base, mask=ok, other=float("-inf"))
        s = tl.load(part_s_ptr + base, mask=ok, other=0.0)
        arg = tl.load(part_idx_ptr + base, mask=ok, other=vocab)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        mass = s * w  # each slice's share of sum(exp(x - top))
        total = tl.sum(mass, 0)
        greedy = tl.min(tl.where(m == top, arg, vocab), 0)
        # the row's uniform: sampler.row_key(seed, position) hashed once more with the salt
        u = _uniform(_mix32(_row_key(tl.load(seeds_ptr + row), tl.load(pos_ptr + row)) ^ SALT))
        target = u * total
        cum = tl.cumsum(mass, 0)
        # the first slice whose cumulative mass passes the target (the last one should rounding say none does)
        j = tl.min(tl.where(cum > target, parts, SPLITS - 1), 0)
        before = tl.sum(tl.where(parts < j, mass, 0.0), 0)
        m_j = tl.max(tl.where(parts == j, m, float("-inf")), 0)
        w_j = tl.sum(tl.where(parts == j, w, 0.0), 0)
        rest = (target - before) / w_j  # in the slice's own scale, exp(x - m_j)
        inv_t = tl.load(inv_temp_ptr + row)
        cols = tl.arange(0, BLOCK_V)
        lo = j * SPAN
        hi = tl.minimum(lo + SPAN, vocab)
        # loop-carried scalars typed as tensors from the start (float32 sum, int32 token ids)
        run = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
        tok = vocab + 0
        last = vocab * 0 - 1
        for start in range(0, SPAN, BLOCK_V):
            idx = lo + start + cols
            x = tl.load(logits_ptr + row * stride_l + idx, mask=idx < hi, other=float("-inf")).to(tl.float32) * inv_t
            e = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_j))
            cs = run + tl.cumsum(e, 0)
            tok = tl.minimum(tok, tl.min(tl.where((cs > rest) & (e > 0.0), idx, vocab), 0))
            last = tl.maximum(last, tl.max(tl.where(e > 0.0, idx, -1), 0))
            run += tl.sum(e, 0)
        tok = tl.where(tok == vocab, last, tok)  # rounding carried the rest past this scan's sum: its last token
        tok = tl.where(tl.load(noise_ptr + row) > 0.0, tok, greedy)
        chosen = tl.load(logits_ptr + row * stride_l + tok).to(tl.float32) * inv_t
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, chosen - top - tl.log(total))


def cdf_sample(logits: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor, *, splits: int, span: int, block_v: int = 1024,
               num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 [B], logprobs float32 [B]) of the inverse-CDF draw; `splits` slices of `span` tokens
    (triton_ops.fused_sample chooses them)."""
    rows, vocab = logits.shape
    dev = logits.device
    part_m = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    part_s = torch.empty(rows, splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    _cdf_stats_kernel[(rows, splits)](logits, inv_temp, part_m, part_s, part_idx, vocab, logits.stride(0),
                                      SPAN=span, SPLITS=splits, BLOCK_V=block_v, num_warps=num_warps)
    _cdf_pick_kernel[(rows,)](logits, inv_temp, noise, seeds, positions, part_m, part_s, part_idx, tokens, logprobs,
                              vocab, logits.stride(0), SPAN=span, SPLITS=splits,
                              SPLITS_PAD=max(2, triton.next_power_of_2(splits)), BLOCK_V=block_v, SALT=ROW_SALT,
                              num_warps=num_warps)
    return tokens, logprobs

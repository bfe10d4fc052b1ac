"""Sampler: temperature, top-k, top-p, min-p, repetition penalty and greedy, with the reported logprob.

Sampling is Gumbel-max: token = argmax(processed_logits / T + g) with g = -log(-log(u)), and u a hash of
(per-request seed, token position, token id). This draws exactly from softmax(processed / T), needs no RNG
state (so it works inside CUDA graphs and gives the same tokens whatever the batch or after preemption) and
fuses into one pass over the vocabulary (triton_ops.fused_sample on the GPU).

The reported logprob is log_softmax(raw_logits / T)[token] (T = 1 when greedy), what the trainer
recomputes: the filters decide which token is drawn, not the logprob (see cohort.types.SamplingParams).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cohort.engine import triton_ops
from cohort.engine.noise import _MASK32, mix32, uniform_from_hash
from cohort.engine.sequence import Sequence


def row_key(seed: int, position: int) -> int:
    """32-bit noise key of the token at `position` of a request with `seed` (any non-negative int)."""
    key = mix32((seed >> 32) & _MASK32)
    key = mix32(key ^ (seed & _MASK32))
    return mix32(key ^ (position & _MASK32))


def row_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Vectorised `row_key` over int64 arrays (seeds below 2**63)."""
    key = mix32((seeds >> 32) & _MASK32)
    key = mix32(key ^ (seeds & _MASK32))
    return mix32(key ^ (positions & _MASK32))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 standard Gumbel noise from int64 row keys (same bits as the Triton kernel)."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    h = mix32((keys[:, None] + ids[None, :] * 0x61C88647) & _MASK32)
    return -torch.log(-torch.log(uniform_from_hash(h)))


def sample_plain(logits: torch.Tensor, inv_temp: torch.Tensor, noise: torch.Tensor, seeds: torch.Tensor,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs) of plain sampling rows with the keys computed on the device: the PyTorch twin of
    triton_ops.fused_sample (no host values, so it can run inside a multi-step decode loop)."""
    keys = mix32((seeds >> 32) & _MASK32)
    keys = mix32(keys ^ (seeds & _MASK32))
    keys = mix32(keys ^ (positions & _MASK32))
    scaled = logits.float() * inv_temp[:, None]
    tokens = (scaled + noise[:, None] * gumbel_noise(keys, logits.shape[-1])).argmax(-1)
    logprobs = scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)
    return tokens, logprobs


def apply_repetition_penalty(logits: torch.Tensor, seqs: list[Sequence], penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: every token seen (prompt and completion) has its logit divided (>0) or multiplied."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for row, seq in enumerate(seqs):
        if seq.params.repetition_penalty != 1.0:
            seen[row, torch.tensor(seq.token_ids, device=logits.device)] = True
    p = penalty[:, None]
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def apply_filters(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what min-p, top-k and top-p exclude from temperature-scaled logits [B, V]."""
    neg_inf = torch.tensor(float("-inf"), device=scaled.device)
    if bool((min_p > 0).any()):
        probs = scaled.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p[:, None]
        scaled = torch.where(probs < floor, neg_inf, scaled)
    sorted_vals, order = scaled.sort(-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_vals = torch.where(drop, neg_inf, sorted_vals)
    probs = sorted_vals.softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    before = probs.cumsum(-1) - probs
    drop = drop | ((before >= top_p[:, None]) & (ranks > 0))
    sorted_vals = torch.where(drop, neg_inf, sorted_vals)
    return torch.empty_like(scaled).scatter_(-1, order, sorted_vals)


def temperature_rows(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    """Per-row 1/T (1 for greedy) and noise scale (0 for greedy, 1 when sampling), float32."""
    temps = np.fromiter((s.params.temperature for s in seqs), dtype=np.float32, count=len(seqs))
    sampled = temps > 0
    inv_temp = np.where(sampled, 1.0 / np.where(sampled, temps, 1.0), 1.0).astype(np.float32)
    return inv_temp, sampled.astype(np.float32)


def needs_processing(seqs: list[Sequence]) -> bool:
    """Whether any row uses a penalty or a filter (then the fused in-graph sampler cannot serve the step)."""
    return any(
        p.repetition_penalty != 1.0 or p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in (s.params for s in seqs)
    )


def aligned_width(n: int) -> int:
    """Row width of the sampler's stacked per-row inputs: n padded to a multiple of 4 elements, so every row
    starts 16-byte aligned (see aligned_rows; Sampler.warm compiles for the same widths)."""
    return -(-max(n, 1) // 4) * 4


def aligned_rows(rows: list[np.ndarray], dtype) -> np.ndarray:
    """Stack 1-D arrays as rows whose starts are 16-byte aligned (width padded to a multiple of 4).

    Triton compiles a kernel once per pointer alignment class: a [2, n] stack puts its second row at n * 4
    or n * 8 bytes, so every odd n (and n % 4 != 0 for float32) compiled a new sampler mid-generation, a
    250-300 ms stall measured three times in one run of bench/rollout.py's mixed workload."""
    n = len(rows[0])
    out = np.zeros((len(rows), aligned_width(n)), dtype=dtype)
    for i, row in enumerate(rows):
        out[i, :n] = row
    return out


class Sampler:
    """Turns one logits row per sequence into (token, logprob), using the fused kernel when it can."""

    def __init__(self, device: torch.device, use_triton: bool | None = None) -> None:
        if use_triton is None:
            use_triton = device.type == "cuda" and triton_ops.triton is not None
        self.device = device
        self.use_triton = use_triton
        # generation.logprob_parity=exact: (logits, tokens, inv_temp) -> the trainer's log-probabilities of the
        # drawn tokens (the engine sets it to its decoder's sampled-token kernel); None: the sampler's own
        self.exact_logprobs: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        tokens, logprobs = self.sample(logits, seqs)
        return tokens.tolist(), logprobs.tolist()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(seqs)
        inv_temp_np, noise_np = temperature_rows(seqs)
        seeds = np.fromiter((s.seed for s in seqs), dtype=np.int64, count=n)
        positions = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=n)
        floats = torch.from_numpy(aligned_rows([inv_temp_np, noise_np], np.float32)).to(self.device, non_blocking=True)
        inv_temp, noise = floats[0, :n], floats[1, :n]
        choice = self._processed(logits, seqs)
        if self.use_triton:
            ints = torch.from_numpy(aligned_rows([seeds, positions], np.int64)).to(self.device, non_blocking=True)
            choice_scaled_input = logits if choice is None else choice
            tokens, logprobs = triton_ops.fused_sample(logits, choice_scaled_input.contiguous(), inv_temp, noise,
                                                       ints[0, :n], ints[1, :n])
            return tokens, self._reported(logits, tokens, logprobs, inv_temp)
        keys = torch.from_numpy(row_keys(seeds, positions)).to(self.device, non_blocking=True)
        scaled = logits.float() * inv_temp[:, None]
        chosen_scaled = scaled if choice is None else choice.float() * inv_temp[:, None]
        score = chosen_scaled + noise[:, None] * gumbel_noise(keys, logits.shape[-1])
        tokens = score.argmax(-1)
        logprobs = scaled.gather(-1, tokens[:, None])[:, 0] - scaled.logsumexp(-1)
        return tokens, self._reported(logits, tokens, logprobs, inv_temp)

    def _reported(self, logits, tokens, logprobs, inv_temp):
        return logprobs if self.exact_logprobs is None else self.exact_logprobs(logits, tokens, inv_temp)

    @torch.inference_mode()
    def warm(self, vocab: int, max_rows: int, dtype: torch.dtype) -> int:
        """Compile the fused sampler for every slice count a step of 1..max_rows rows can use (each count is
        its own Triton kernel), so no generation pays a compile; returns how many variants ran. No-op
        without Triton."""
        if not self.use_triton:
            return 0
        firsts: dict[int, int] = {}
        for rows in range(1, max_rows + 1):
            firsts.setdefault(triton_ops.sample_splits(rows, vocab), rows)
        # rows with filters sample their processed logits with the Gumbel pass whatever SAMPLER_PASS says
        methods = sorted({"gumbel", triton_ops.SAMPLER_PASS})
        for rows in firsts.values():
            logits = torch.zeros(rows, vocab, dtype=dtype, device=self.device)
            floats = torch.ones(2, aligned_width(rows), device=self.device)
            ints = torch.zeros(2, aligned_width(rows), dtype=torch.int64, device=self.device)
            for method in methods:
                triton_ops.fused_sample(logits, logits, floats[0, :rows], floats[1, :rows], ints[0, :rows],
                                        ints[1, :rows], method=method)
            # the filtered rows' variant: the processed values are a tensor of their own
            triton_ops.fused_sample(logits, logits.clone(), floats[0, :rows], floats[1, :rows], ints[0, :rows],
                                    ints[1, :rows], method="gumbel")
        return len(firsts) * (len(methods) + 1)

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
        """Logits after penalties and filters, still at temperature 1 (None when nothing applies)."""
        params = [s.params for s in seqs]
        use_penalty = any(p.repetition_penalty != 1.0 for p in params)
        use_filters = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        if not (use_penalty or use_filters):
            return None
        out = logits.float()
        if use_penalty:
            penalty = torch.tensor([p.repetition_penalty for p in params], device=self.device)
            out = apply_repetition_penalty(out, seqs, penalty)
        if use_filters:
            temps = torch.tensor([p.logprob_temperature for p in params], device=self.device)
            top_k = torch.tensor([p.top_k for p in params], device=self.device)
            top_p = torch.tensor([p.top_p for p in params], device=self.device)
            min_p = torch.tensor([p.min_p for p in params], device=self.device)
            # Filters act on the tempered distribution; scale back so the caller's 1/T applies uniformly.
            out = apply_filters(out / temps[:, None], top_k, top_p, min_p) * temps[:, None]
        return out

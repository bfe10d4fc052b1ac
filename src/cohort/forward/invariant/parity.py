"""generation.logprob_parity on a model: the mark both sides read, the trainer's exact packed pass, the log-probs.

`set_logprob_parity(model, "exact")` (set-up, before the engine is built) checks the model and marks it: the
engine's decoder (engine/models/decoder.py) reads the mark with `is_exact`, and the model's `cohort_packed_pass`
(the method forward/packing.packed_forward_logprobs calls for a packed row when the model has one, as an FSDP root
does) becomes `exact_packed_pass`. Both then run the batch-invariant forward (decoder.InvariantDecoder) instead of
their fast paths. Mark and method are attributes of the model object, so a reference copy made from the policy
(copy.deepcopy) carries them, bound to the copy.

The chosen token's log-probability is `kernels.token_logprobs` of the LM head's logits (the invariant matmul) on
both sides: the engine after its sampler drew the token (`engine_logprobs`), the trainer in `exact_logprobs`
(chunks of tokens; entropy from the same logits; the backward is forward/logprobs' recomputing one). The inverse
temperature is the float32 1/T on both sides (`inverse_temperature`), as the engine's sampler computes it.
"""

from __future__ import annotations

import types

import numpy as np
import torch
from torch import nn

from cohort.errors import ConfigError
from cohort.forward.invariant import kernels, ops
from cohort.forward.invariant.decoder import InvariantDecoder, causal_lm, rope_table, unsupported
from cohort.forward.logprobs import _SelectiveLogprobs
from cohort.types import RolloutBatch

MODES = ("fast", "exact")
_ATTR = "_cohort_logprob_parity"
ENTROPY_ROWS = 256  # rows of a chunk's float32 log-probabilities at a time (the entropy; not part of parity)
PACKED_METHOD = "cohort_packed_pass"  # what packed_forward_logprobs runs for a row when the model has it


def set_logprob_parity(model: nn.Module, mode: str) -> None:
    """Mark `model` for `mode`; exact checks the model and Triton first (a ConfigError saying why and the fix)."""
    if mode not in MODES:
        raise ConfigError(f"generation.logprob_parity={mode!r} is not a parity mode; choose one of {', '.join(MODES)}")
    if mode == "exact":
        reason = unsupported(model)
        if reason is None and not kernels.available(next(model.parameters()).device):
            reason = "its kernels need Triton and a CUDA device (TRITON_INTERPRET=1 runs them on the CPU, for tests)"
        if reason is not None:
            raise ConfigError(f"generation.logprob_parity=exact is not available for {type(model).__name__}: {reason}; "
                             "set generation.logprob_parity=fast")
    object.__setattr__(model, _ATTR, mode)  # a plain attribute, not a submodule or parameter
    if mode == "exact":
        object.__setattr__(model, PACKED_METHOD, types.MethodType(exact_packed_pass, model))
    elif isinstance(getattr(model, PACKED_METHOD, None), types.MethodType) and \
            getattr(model, PACKED_METHOD).__func__ is exact_packed_pass:
        delattr(model, PACKED_METHOD)


def is_exact(model: nn.Module) -> bool:
    return getattr(model, _ATTR, "fast") == "exact"


def inverse_temperature(temperature: float) -> float:
    """1/T as the engine's sampler computes it (float32 division of float32 values); T <= 0 (greedy) gives 1."""
    if temperature <= 0:
        return 1.0
    return float(np.float32(1.0) / np.float32(temperature))


def engine_logprobs(logits: torch.Tensor, tokens: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """The sampled tokens' log_softmax(logits * inv_temp), float32 [B]: what the trainer's exact pass computes."""
    return kernels.token_logprobs(logits, tokens, inv_temp)[0]


class _ExactLogprobs(_SelectiveLogprobs):
    """Chosen-token logprobs (and entropy) with the invariant LM head and log-softmax forward; the backward is
    _SelectiveLogprobs' (recomputed logits, cuBLAS)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_t, chunk_tokens, compute_entropy, grad_w_fp32, keep_logits):
        n, device = hidden.shape[0], hidden.device
        logprobs = torch.empty(n, dtype=torch.float32, device=device)
        lse = torch.empty(n, dtype=torch.float32, device=device)
        entropy = torch.zeros(n if compute_entropy else 0, dtype=torch.float32, device=device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = kernels.linear(hidden[start:end], weight)
            rows = torch.full((end - start,), inv_t, dtype=torch.float32, device=device)
            logprobs[start:end], lse[start:end] = kernels.token_logprobs(logits, labels[start:end], rows)
            for sub in range(0, end - start if compute_entropy else 0, ENTROPY_ROWS):  # bounded fp32 temporaries
                logp = logits[sub:sub + ENTROPY_ROWS].float() * inv_t - lse[start + sub:start + sub + ENTROPY_ROWS, None]
                entropy[start + sub:start + sub + ENTROPY_ROWS] = -(logp.exp() * logp).sum(-1)
            del logits
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.inv_t, ctx.chunk_tokens, ctx.grad_w_fp32, ctx.kept_logits = inv_t, chunk_tokens, grad_w_fp32, None
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy


def exact_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float,
                   chunk_tokens: int, compute_entropy: bool, lm_head_grad_fp32: bool = True):
    """(logprobs [N] float32, entropy [N] or None) of `labels` under log_softmax(hidden @ W^T / T), invariant."""
    lp, ent = _ExactLogprobs.apply(hidden, weight, labels.long(), inverse_temperature(temperature), int(chunk_tokens),
                                   compute_entropy, bool(lm_head_grad_fp32), False)
    return lp, (ent if compute_entropy else None)


def exact_packed_pass(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cu: torch.Tensor,
                      hidden_idx: torch.Tensor, labels: torch.Tensor, *, temperature: float, compute_entropy: bool,
                      chunk_tokens: int, max_len: int | None = None, lm_head_grad_fp32: bool = True,
                      attn: str = "varlen", keep_logits: bool = False, router_aux_loss: bool = False,
                      kv_index=None, **_shared):
    """forward/packing.packed_pass in exact parity: the invariant decoder over the packed row, then the invariant
    logprobs of the labels. input_ids/position_ids [1, T]; cu [N + 1] segment bounds. keep_logits has no effect
    (the backward recomputes the logits); attn is always the invariant kernel. Shared-prompt rows and the router
    loss are refused at set-up (config/checks)."""
    if kv_index is not None or router_aux_loss:
        raise ValueError("generation.logprob_parity=exact runs plain packed rows: set train.share_prompts=false")
    decoder = _decoder_of(model)
    ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
    if max_len is None:
        max_len = int((cu[1:] - cu[:-1]).max())
    cos, sin = rope_table(model, max_len)
    cos, sin = cos[:, pos], sin[:, pos]
    starts = torch.arange(ids.shape[0], device=ids.device) - pos  # each token's segment start in the row

    def attend(i, q, k, v, window):
        return ops.packed_attention(q, k, v, starts, pos, cu, max_len, decoder.scale, window)

    hidden = decoder.hidden(ids, cos, sin, attend).index_select(0, hidden_idx)
    weight = decoder.hf.lm_head.weight
    logprobs, entropy = exact_logprobs(hidden, weight, labels, temperature=temperature, chunk_tokens=chunk_tokens,
                                       compute_entropy=compute_entropy, lm_head_grad_fp32=lm_head_grad_fp32)
    return logprobs.clone(), None if entropy is None else entropy.clone()


_DECODERS: dict[int, InvariantDecoder] = {}


def _decoder_of(model: nn.Module) -> InvariantDecoder:
    """One InvariantDecoder per model object (it holds only references to the model's modules)."""
    key = id(model)
    found = _DECODERS.get(key)
    if found is None or found.hf is not causal_lm(model):  # a new model at a freed one's address
        found = _DECODERS[key] = InvariantDecoder(model)
    return found


def sampled_old_logprobs(batch: RolloutBatch, device: torch.device) -> dict[int, torch.Tensor] | None:
    """In exact parity, the update's old logprobs without the recompute pass: the engine's sampling logprobs, which
    are the recompute's bits (the same weights, forward and kernels). None where they are not: a row with tokens
    the engine did not sample (tool results report 0) or sampled by a served engine (a policy version)."""
    rows = range(len(batch))
    masks = batch.completion_masks  # a per-token mask marks a multi-turn row's tool results
    if batch.policy_versions is not None or (masks is not None and any(m is not None for m in masks)):
        return None
    return {r: torch.tensor(batch.sampling_logprobs[r], dtype=torch.float32).to(device) for r in rows}

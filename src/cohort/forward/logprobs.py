"""Log-probabilities and entropy of chosen tokens without materialising [tokens, vocab] logits.

The policy loss needs, for every completion token, `log_softmax(h @ W^T / T)[label]` and (for logging and
entropy-based masks) the entropy of that distribution. Computing the full logits of 8k tokens over a 152k
vocabulary costs 5 GB in fp32, more than the whole 0.5B model. Here the tokens are processed in chunks of
`chunk_tokens`: the forward keeps only per-token scalars (logprob, logsumexp, entropy), and the backward
recomputes each chunk's logits and turns them into gradients for the hidden states and the LM-head weight.
Peak extra memory is about one chunk's logits, whatever the number of tokens.

keep_logits=True (train.keep_logits) trades that memory for time: the forward keeps every chunk's raw logits
(N x vocab in the weights' dtype) and the backward uses them instead of redoing the LM-head matmul (about
25 ms of a 0.68 s Qwen2.5-0.5B update on an H100); each chunk is released as soon as its gradient is made.
On CUDA, where torch offers bf16 matmuls with an fp32 output (torch.addmm(..., out_dtype=float32)), the
LM-head weight gradient is accumulated straight into its fp32 buffer (no [vocab, hidden] bf16 temporary).

Gradients, with z = logits / T, log p = z - lse and H = -sum(p log p) saved from the forward:
  d logp[label] / dz = onehot(label) - p
  d H / dz           = -p * (log p + H)
and dz / d(raw logits) = 1 / T. Because lse and H are saved, the backward is one elementwise pass over the
recomputed (or kept) logits, no reduction, written over them. On CUDA both per-chunk passes are Triton kernels
(cohort.forward.triton_logprobs: the statistics in one read of the row, the gradient in one read and one write);
COHORT_TRITON_LOGPROBS=0 takes torch.compile'd versions of the same functions instead (the unfused eager code
makes ~8 passes over [chunk, vocab] fp32 and costs more than the three matmuls), and COHORT_COMPILE_LOGPROBS=0
with it the eager code. The CPU runs the in-place eager code.
"""

from __future__ import annotations

import os
import warnings

import torch

from cohort.forward import triton_logprobs

DEFAULT_CHUNK_TOKENS = 4096


# ---------------------------------------------------------------------------------------------------------
# Per-chunk elementwise work. `logits` are the raw h @ W^T in the weights' dtype.


def _stats_eager(logits, labels, inv_t: float, compute_entropy: bool):
    """(chosen logprob, logsumexp, entropy or None), fp32 [n]; at most two [n, V] fp32 buffers."""
    z = logits.float()
    if inv_t != 1.0:
        z.mul_(inv_t)
    lse = torch.logsumexp(z, dim=-1)
    chosen = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if compute_entropy:
        # H = -sum p log p on log p = z - lse: no cancellation between two large numbers.
        logp = z.sub_(lse.unsqueeze(-1))
        entropy = -torch.bmm(logp.exp().unsqueeze(1), logp.unsqueeze(2)).view(-1)
    return chosen, lse, entropy


def _grad_eager(logits, labels, lse, entropy, grad_lp, grad_ent, inv_t: float):
    """d loss / d raw logits in the logits' dtype, written over `logits` (the caller's last use of them):
    in place on one fp32 buffer plus p."""
    z = logits.float()
    if inv_t != 1.0:
        z.mul_(inv_t)
    z.sub_(lse.unsqueeze(-1))  # log p
    p = z.exp()
    # -p * [(log p + H) * gH + gL]  +  onehot * gL
    z.add_(entropy.unsqueeze(-1)).mul_(grad_ent.unsqueeze(-1)).add_(grad_lp.unsqueeze(-1)).mul_(p).neg_()
    z.scatter_add_(-1, labels.unsqueeze(-1), grad_lp.unsqueeze(-1))
    if inv_t != 1.0:
        z.mul_(inv_t)
    # fp32 logits are z itself; otherwise round into the logits' buffer instead of allocating another
    return z if z is logits else logits.copy_(z)


def _stats_fused(logits, labels, inv_t: float, compute_entropy: bool):
    z = logits.float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    chosen = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not compute_entropy:
        return chosen, lse, None
    logp = z - lse.unsqueeze(-1)
    return chosen, lse, -(logp.exp() * logp).sum(-1)


def _grad_fused(logits, labels, lse, entropy, grad_lp, grad_ent, inv_t: float):
    logp = logits.float() * inv_t - lse.unsqueeze(-1)
    p = logp.exp()
    g = -p * ((logp + entropy.unsqueeze(-1)) * grad_ent.unsqueeze(-1) + grad_lp.unsqueeze(-1))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    g = g + (vocab.unsqueeze(0) == labels.unsqueeze(-1)) * grad_lp.unsqueeze(-1)
    return (g * inv_t).to(logits.dtype)


_COMPILED: dict[str, object] = {}


def _kernels(device: torch.device):
    """(stats, grad) functions: torch.compile'd on CUDA unless disabled or unavailable, eager otherwise."""
    if device.type != "cuda" or os.environ.get("COHORT_COMPILE_LOGPROBS", "1") == "0" or "failed" in _COMPILED:
        return _stats_eager, _grad_eager
    if not _COMPILED:
        _COMPILED["stats"] = torch.compile(_stats_fused, dynamic=True)
        _COMPILED["grad"] = torch.compile(_grad_fused, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


def _eager(which: int, args, keep_input: bool):
    if keep_input and which == 0 and args[0].dtype == torch.float32:
        # the eager statistics work in place on their fp32 copy, which for fp32 logits is the input itself
        args = (args[0].clone(), *args[1:])
    return (_stats_eager, _grad_eager)[which](*args)


def _call(which: int, device, *args, keep_input: bool = False):
    """Run a kernel; if compilation fails once, warn and use the eager code from then on. On CUDA the forward
    statistics (one pass) and the backward's gradient (written over the logits) are Triton kernels
    (cohort.forward.triton_logprobs) unless COHORT_TRITON_LOGPROBS=0, which takes the torch.compile'd functions.
    keep_input: the caller keeps the logits (args[0]) after the statistics, which must not change them."""
    if triton_logprobs.available(device) and os.environ.get("COHORT_TRITON_LOGPROBS", "1") != "0":
        return (triton_logprobs.stats, triton_logprobs.grad)[which](*args)
    fn = _kernels(device)[which]
    if fn in (_stats_eager, _grad_eager):
        return _eager(which, args, keep_input)
    # The vocabulary is the kernels' reduction / row width: static, so inductor sizes its blocks for it (a
    # symbolic width gives generic looped kernels); the chunk's token count stays dynamic.
    torch._dynamo.mark_static(args[0], args[0].dim() - 1)
    try:
        return fn(*args)
    except Exception as exc:  # compile errors come in many types (backend, codegen, missing compiler)
        warnings.warn(f"torch.compile of the logprob kernel failed ({exc!r}); using eager code", stacklevel=3)
        _COMPILED["failed"] = True
        return _eager(which, args, keep_input)


_FP32_OUT_ADDMM: dict[torch.device, bool] = {}


def _fp32_out_addmm(device: torch.device) -> bool:
    """Whether torch.addmm(fp32 C, bf16 A, bf16 B, out_dtype=float32, out=C) works and is right on `device`:
    tried once per device on small matrices against an fp32 reference. CUDA only (torch has no CPU kernel for
    out_dtype); older torch releases reject an fp32 C or the keyword."""
    if device.type != "cuda":
        return False
    if device not in _FP32_OUT_ADDMM:
        ok = False
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(64, 48, device=device, generator=gen).bfloat16()
            b = torch.randn(48, 32, device=device, generator=gen).bfloat16()
            c = torch.randn(64, 32, device=device, generator=gen)
            want = c + a.float() @ b.float()
            torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
            ok = c.dtype == torch.float32 and torch.allclose(c, want, rtol=1e-3, atol=1e-3)
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FP32_OUT_ADDMM[device] = ok
    return _FP32_OUT_ADDMM[device]


# ---------------------------------------------------------------------------------------------------------


class _SelectiveLogprobs(torch.autograd.Function):
    """Chunked logprob + entropy whose backward recomputes logits chunk by chunk (or, keep_logits, uses the
    chunks the forward kept)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens, compute_entropy, grad_w_fp32, keep_logits):
        n, device, inv_t = hidden.shape[0], hidden.device, 1.0 / temperature
        logprobs = torch.empty(n, dtype=torch.float32, device=device)
        lse = torch.empty(n, dtype=torch.float32, device=device)
        entropy = torch.zeros(n if compute_entropy else 0, dtype=torch.float32, device=device)
        # A plain list on ctx, not save_for_backward: the backward drops each chunk as soon as it is used,
        # which saved tensors (held until the whole backward ends) would not allow.
        kept: list[torch.Tensor | None] | None = [] if keep_logits else None
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = hidden[start:end] @ weight.t()
            chosen, chunk_lse, chunk_ent = _call(0, device, logits, labels[start:end], inv_t, compute_entropy,
                                                 keep_input=keep_logits)
            if kept is not None:
                kept.append(logits)
            del logits
            logprobs[start:end], lse[start:end] = chosen, chunk_lse
            if compute_entropy:
                entropy[start:end] = chunk_ent
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.inv_t, ctx.chunk_tokens, ctx.grad_w_fp32, ctx.kept_logits = inv_t, chunk_tokens, grad_w_fp32, kept
        if not compute_entropy:
            # autograd.Function outputs must be tensors: an empty placeholder that carries no gradient.
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        n, chunk, device = hidden.shape[0], ctx.chunk_tokens, hidden.device
        zeros = torch.zeros(n, dtype=torch.float32, device=device)
        gl = zeros if grad_logprobs is None else grad_logprobs.float()
        use_entropy = grad_entropy is not None and grad_entropy.numel() == n
        ge = grad_entropy.float() if use_entropy else zeros
        ent = entropy if use_entropy else zeros
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # The weight gradient sums over every token: accumulate it in fp32 and cast once at the end, or
        # (grad_w_fp32=False, the low-memory setting) add each chunk's product in place into a buffer of the
        # weight's dtype: each matmul still accumulates in fp32 inside, only the sum over chunks rounds.
        fp32_sum = need_w and (ctx.grad_w_fp32 or weight.dtype == torch.float32)
        grad_w = None
        if need_w:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32 if fp32_sum else weight.dtype, device=device)
        # bf16 products added straight into the fp32 sum by the matmul itself, where torch can (CUDA)
        fp32_out = fp32_sum and weight.dtype == torch.bfloat16 and _fp32_out_addmm(device)
        # The forward's logits, taken off ctx so they go with this backward (a second backward over a retained
        # graph finds none and recomputes); each chunk leaves the list before its gradient is made, so it is
        # freed as soon as the gradient kernel is done with it.
        kept, ctx.kept_logits = ctx.kept_logits, None
        for i, start in enumerate(range(0, n, chunk)):
            end = min(start + chunk, n)
            h = hidden[start:end]
            if kept is not None:
                logits, kept[i] = kept[i], None
            else:
                logits = h @ weight.t()
            g = _call(1, device, logits, labels[start:end], lse[start:end], ent[start:end],
                      gl[start:end], ge[start:end], ctx.inv_t)
            del logits
            if need_h:
                grad_h[start:end] = (g @ weight).to(hidden.dtype)
            if fp32_out:
                torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)
            elif fp32_sum:
                # Matmul in the weights' dtype (bf16 tensor cores), sum over chunks in fp32.
                grad_w.add_(g.t() @ h)
            elif need_w:
                grad_w.addmm_(g.t(), h)  # no [vocab, hidden] temporary
            del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def selective_logprobs_and_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_entropy: bool = True,
    lm_head_grad_fp32: bool = True,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each label under `log_softmax(hidden @ W^T / temperature)`, and the entropy.

    hidden_states: [N, d] (or [..., d], flattened), lm_head_weight: [V, d], labels: [N] long.
    Returns (logprobs [N] fp32, entropy [N] fp32 or None when compute_entropy is False). Both are
    differentiable with respect to hidden_states and lm_head_weight; the backward recomputes the logits
    chunk by chunk instead of storing them. lm_head_grad_fp32=False sums the weight gradient over chunks in
    the weight's dtype (no fp32 [vocab, hidden] buffer; the low-memory setting). keep_logits=True keeps the
    forward's logits (N x V in the weights' dtype) for the backward instead of recomputing them: faster, and
    only when a backward can follow (grad mode on, an input that requires grad).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy rollouts use logprob temperature 1.0)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    shape = labels.shape
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = labels.reshape(-1).long()
    if hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"hidden_states has {hidden.shape[0]} tokens but labels has {flat_labels.shape[0]}")
    # under no_grad (old / reference logprobs) no backward comes: nothing to keep
    keep = bool(keep_logits) and torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad)
    logprobs, entropy = _SelectiveLogprobs.apply(
        hidden, lm_head_weight, flat_labels, float(temperature), int(chunk_tokens), compute_entropy,
        bool(lm_head_grad_fp32), keep
    )
    if not compute_entropy:
        return logprobs.reshape(shape), None
    return logprobs.reshape(shape), entropy.reshape(shape)


def full_logprobs_and_entropy(
    hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference implementation over full logits (tests and tiny inputs only: memory grows with N x V)."""
    z = (hidden_states @ lm_head_weight.t()).float() / temperature
    logp = torch.log_softmax(z, dim=-1)
    chosen = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy

"""Log-probabilities and entropy of chosen tokens without materialising [tokens, vocab] logits.

The policy loss needs, for every completion token, `log_softmax(h @ W^T / T)[label]` and (for logging and
entropy-based masks) the entropy of that distribution. Computing the full logits of 8k tokens over a 152k
vocabulary costs 5 GB in fp32, more than the whole 0.5B model. Here the tokens are processed in chunks of
`chunk_tokens`: the forward keeps only per-token scalars, and the backward recomputes each chunk's logits and
turns them into gradients for the hidden states and the LM-head weight at once. Peak extra memory is one
chunk's logits (plus its softmax), whatever the number of tokens.

Gradients, with z = logits / T and p = softmax(z):
  d logp[label] / dz = onehot(label) - p
  d H / dz           = -p * (log p - sum(p * log p))    (H = -sum(p * log p))
and dz / d(raw logits) = 1 / T.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_TOKENS = 1024


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """fp32 scaled logits of one chunk, their logsumexp, and the chosen tokens' logprobs."""
    z = (h @ weight.t()).float()
    if temperature != 1.0:
        z.div_(temperature)
    lse = torch.logsumexp(z, dim=-1)
    chosen = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    return z, lse, chosen


def _chunk_grad(h, weight, labels, temperature, grad_lp, grad_ent):
    """d loss / d raw logits of one chunk, in the weights' dtype. Only two [chunk, V] fp32 buffers live at
    once (z and p): every update is in place."""
    z, lse, _ = _chunk_stats(h, weight, labels, temperature)
    z.sub_(lse.unsqueeze(-1))  # z now holds log p (shift-invariant gradients, better precision)
    p = z.exp()
    if grad_ent is not None:
        # dH/dz = -p * (log p - E_p[log p]); z becomes the gradient buffer.
        mean_logp = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1, 1)
        z.sub_(mean_logp).mul_(p).mul_(-grad_ent.float().unsqueeze(-1))
    else:
        z.zero_()
    if grad_lp is not None:
        gl = grad_lp.float().unsqueeze(-1)
        z.addcmul_(p, gl, value=-1.0)  # d logp / dz = onehot - p
        z.scatter_add_(-1, labels.unsqueeze(-1), gl)
    del p
    if temperature != 1.0:
        z.div_(temperature)
    return z.to(weight.dtype)


class _SelectiveLogprobs(torch.autograd.Function):
    """Chunked logprob + entropy whose backward recomputes logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens, compute_entropy):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if compute_entropy else None
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            z, lse, chosen = _chunk_stats(hidden[start:end], weight, labels[start:end], temperature)
            logprobs[start:end] = chosen
            if entropy is not None:
                # H = -sum p log p on log p = z - lse: no cancellation between two large numbers.
                logp = z.sub_(lse.unsqueeze(-1))
                entropy[start:end] = -torch.bmm(logp.exp().unsqueeze(1), logp.unsqueeze(2)).view(-1)
            del z
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        ctx.compute_entropy = compute_entropy
        if entropy is None:
            # autograd.Function outputs must be tensors: an empty placeholder that carries no gradient.
            entropy = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk_tokens
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # The weight gradient sums over every token: accumulate it in fp32, cast once at the end.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        use_entropy = ctx.compute_entropy and grad_entropy is not None and grad_entropy.numel() > 0
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            g = _chunk_grad(h, weight, labels[start:end], temperature,
                            None if grad_logprobs is None else grad_logprobs[start:end],
                            grad_entropy[start:end] if use_entropy else None)
            if need_h:
                grad_h[start:end] = (g @ weight).to(hidden.dtype)
            if need_w:
                # Matmul in the weights' dtype (bf16 tensor cores), sum over chunks in fp32.
                grad_w.add_(g.t() @ h)
            del g
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def selective_logprobs_and_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each label under `log_softmax(hidden @ W^T / temperature)`, and the entropy.

    hidden_states: [N, d] (or [..., d], flattened), lm_head_weight: [V, d], labels: [N] long.
    Returns (logprobs [N] fp32, entropy [N] fp32 or None when compute_entropy is False). Both are
    differentiable with respect to hidden_states and lm_head_weight; the backward recomputes the logits
    chunk by chunk instead of storing them.
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
    logprobs, entropy = _SelectiveLogprobs.apply(
        hidden, lm_head_weight, flat_labels, float(temperature), int(chunk_tokens), compute_entropy
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

"""Log-probabilities and entropy of chosen tokens without materialising [tokens, vocab] logits.

The policy loss needs, for every completion token, `log_softmax(h @ W^T / T)[label]` and (for logging and
entropy-based masks) the entropy of that distribution. Computing the full logits of 8k tokens over a 152k
vocabulary costs 5 GB in fp32, more than the whole 0.5B model. Here the tokens are processed in chunks of
`chunk_tokens`: the forward keeps only per-token scalars, and the backward recomputes each chunk's logits and
turns them into gradients for the hidden states and the LM-head weight at once. Peak extra memory is one
chunk's logits (plus its softmax), whatever the number of tokens.

Gradients, with z = logits / T and p = softmax(z):
  d logp[label] / dz = onehot(label) - p
  d H / dz           = -p * (z - sum(p * z))            (H = logsumexp(z) - sum(p * z))
and dz / d(raw logits) = 1 / T.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_TOKENS = 1024


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """fp32 scaled logits of one chunk, their logsumexp, and the chosen tokens' logprobs."""
    z = (h @ weight.t()).float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    chosen = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    return z, lse, chosen


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
                entropy[start:end] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
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
            z, lse, _ = _chunk_stats(h, weight, labels[start:end], temperature)
            p = torch.exp(z - lse.unsqueeze(-1))
            g = torch.zeros_like(z)
            if grad_logprobs is not None:
                gl = grad_logprobs[start:end].float().unsqueeze(-1)
                g.scatter_(-1, labels[start:end].unsqueeze(-1), gl)
                g.sub_(p * gl)
            if use_entropy:
                mean_z = (p * z).sum(-1, keepdim=True)
                g.sub_(p * (z - mean_z) * grad_entropy[start:end].float().unsqueeze(-1))
            del z, p
            if temperature != 1.0:
                g.div_(temperature)
            if need_h:
                grad_h[start:end] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(g.t(), h.float())
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

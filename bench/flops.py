"""The FLOPs a GRPO update needs, for the benchmarks' MFU (model FLOPs utilisation).

The usual "6 N per token" counts the LM head on every token. A GRPO update takes logprobs of completion tokens
only: cohort (cohort.forward.packing: the hidden states of completion positions go through the LM head) and TRL
(`logits_to_keep`) both skip the prompt positions' logits, so counting them credits work nobody does (9% of
the 0.5B bench update's FLOPs). What is counted here, per sequence of S = P + C tokens:

- the decoder's weights (every parameter but the embedding and the LM head): 6 FLOPs per weight per token
  (forward 2, input gradient 2, weight gradient 2; 4 when the weights are frozen, as under LoRA);
- the LM head: the same, on the C completion positions only;
- causal attention: QK^T and AV over the i keys of position i, 2 x 2 x d_attn x i forward, twice that
  backward, per layer: 6 x d_attn x S (S + 1) per layer and sequence;
- not counted: recomputation (gradient checkpointing, FlashAttention's backward), the embedding lookup,
  norms and activations, the optimizer.

With shared prompts (cohort's train.share_prompts: one copy of a prompt per row, its `shared` completions after
it) the count is of the work done: the prompt's tokens go through the weights once per group, and its causal
attention (P (P + 1) / 2 query-key pairs) is computed once; each completion still attends to the whole prompt.
"""

from __future__ import annotations


def head_params(spec: dict) -> int:
    """Parameters of the LM head: vocab x hidden."""
    return spec["vocab_size"] * spec["hidden_size"]


def decoder_params(num_params: int, spec: dict, tied: bool) -> int:
    """num_params (the model's, a tied embedding counted once) less the embedding and the LM head."""
    return num_params - head_params(spec) * (1 if tied else 2)


def attention_width(spec: dict) -> int:
    """Query heads x head size (d_attn)."""
    head_dim = spec.get("head_dim") or spec["hidden_size"] // spec["num_attention_heads"]
    return spec["num_attention_heads"] * head_dim


def update_flops(spec: dict, *, num_params: int, tied: bool, sequences: int, prompt_len: int,
                 completion_len: int, weight_grads: bool = True, shared: int = 1) -> float:
    """FLOPs of one update over `sequences` sequences of prompt_len + completion_len tokens (see the module
    docstring). weight_grads=False: frozen weights (LoRA), 4 FLOPs per weight per token instead of 6.
    shared: completions per copy of their prompt (1: every sequence carries its own prompt)."""
    per_weight = 6 if weight_grads else 4
    length = prompt_len + completion_len
    body = per_weight * decoder_params(num_params, spec, tied) * (prompt_len / shared + completion_len)
    head = per_weight * head_params(spec) * completion_len
    prompt_pairs = prompt_len * (prompt_len + 1) / 2
    pairs = prompt_pairs / shared + length * (length + 1) / 2 - prompt_pairs  # query-key pairs per sequence
    attention = 12 * spec["num_hidden_layers"] * attention_width(spec) * pairs
    return float(sequences) * (body + head + attention)

"""Padding-free training forward: many (prompt, completion) pairs packed into one row.

TRL pads every micro-batch to its longest sequence; with completions of 20 to 1000 tokens most of the
compute goes to padding. Here a micro-batch is one row `[p0 c0 p1 c1 ...]` whose position ids restart at
every sequence (`pack_layout`), and attention never crosses a sequence boundary:

- attn="varlen" (default): the model's attention goes through `cohort.forward.packed_attention` (cu_seqlens
  attention: flash varlen on CUDA, SDPA per sequence elsewhere; sliding windows honoured per sequence).
- attn="native": the model's own attention (sdpa/eager) with no attention mask; transformers detects the
  restarting position ids and builds a block-diagonal causal mask ([T, T] booleans, fine on the CPU).

Only the final hidden states are computed by the model; logprobs and entropy of the completion tokens go
through `cohort.forward.logprobs.selective_logprobs_and_entropy`, so [tokens, vocab] logits never exist. A model
whose config sets `final_logit_softcapping` (logits = c * tanh(logits / c)) takes a chunked path with the
cap applied (`_softcapped_logprobs`). `compile_decoder_layers` fuses each decoder layer's small kernels.
Which sequences share a row is decided in `cohort.forward.micro_batches`. With share_prompts, the completions of one
prompt share a single copy of it in the row (`cohort.forward.shared_prompts`). For a mixture-of-experts model,
`router_aux_loss=True` also returns the router load-balancing loss over the row's tokens (`router_load_balancing_loss`).
"""

from __future__ import annotations

import functools
import itertools
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from cohort.forward.logprobs import DEFAULT_CHUNK_TOKENS, selective_logprobs_and_entropy
from cohort.forward.packed_attention import _PACKED_MASKS, VARLEN_IMPL, enable_packed_attention, prepare_flash
from cohort.forward.plugins import has_extra_inputs, row_forward_for
from cohort.forward.recurrent import check_one_sequence
from cohort.forward.router_replay import RouterReplay, row_replay
from cohort.forward.shared_prompts import pack_shared_layout


@dataclass
class PackedLogprobs:
    """Logprobs (and entropy) of every completion token of a packed micro-batch.

    logprobs / entropy: [total completion tokens] fp32, sequence after sequence.
    offsets: B + 1 ints; sequence i's tokens are logprobs[offsets[i]:offsets[i + 1]].
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    offsets: list[int]
    # router_aux_loss=True on a MoE model: the load-balancing loss of the row (a differentiable scalar), and how many
    # tokens the row holds (its weight when micro-batches are accumulated)
    aux_loss: torch.Tensor | None = None
    row_tokens: int = 0
    # padded()'s scatter index on the device, and the (device, rows, width) it was built for
    _index: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _index_key: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def split(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One (logprobs, entropy) pair per sequence."""
        out = []
        for a, b in itertools.pairwise(self.offsets):
            out.append((self.logprobs[a:b], None if self.entropy is None else self.entropy[a:b]))
        return out

    def padded(self, which: str = "logprobs", pad_value: float = 0.0) -> torch.Tensor:
        """[B, T] right-padded tensor (T = longest completion), the layout of `LossInputs`; differentiable.

        One scatter into the padded layout (its backward one gather), not a slice and a copy per sequence:
        with ~100 sequences per micro-batch those small launches (and their backward's zero-filled slices)
        left the GPU idle for ~10% of the update."""
        flat = self.logprobs if which == "logprobs" else self.entropy
        if flat is None:
            raise ValueError(f"padded({which!r}): entropy was not computed (compute_entropy=False)")
        lengths = np.asarray(self.offsets[1:], dtype=np.int64) - np.asarray(self.offsets[:-1], dtype=np.int64)
        rows, width = len(lengths), int(lengths.max(initial=0))
        key = (str(flat.device), rows, width)
        if self._index is None or self._index_key != key:
            # flat position of token k of sequence i in the [B, T] layout: i * T + k
            index = np.repeat(np.arange(rows, dtype=np.int64) * width - np.asarray(self.offsets[:-1]), lengths)
            index += np.arange(len(index), dtype=np.int64)
            self._index, self._index_key = host_to_device(index, flat.device), key
        assert self._index is not None
        out = flat.new_full((rows * width,), pad_value).index_put((self._index,), flat)
        return out.view(rows, width)


def host_to_device(array: np.ndarray, device) -> torch.Tensor:
    """A host array on `device` without making the host wait: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory waits for the whole queue of GPU work to drain)."""
    array = np.ascontiguousarray(array)
    device = torch.device(device)
    if device.type != "cuda":
        return torch.from_numpy(array).to(device)
    # Page-locked memory from torch's caching host allocator, filled by numpy's memcpy: `pin_memory()`'s own
    # copy took 2-3 ms for a few hundred KB on the GPU machines (the update's trace), while the device idled.
    pinned = torch.empty(array.shape, dtype=torch.from_numpy(array).dtype, pin_memory=True)
    np.copyto(pinned.numpy(), array)
    return pinned.to(device, non_blocking=True)


def _to_device(device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """int64 host arrays on `device` in one asynchronous copy (host_to_device), split back."""
    flat = host_to_device(np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]), device)
    return list(flat.split([len(a) for a in arrays]))


def pack_layout(sequences, device):
    """Flat input ids, restarting position ids, cu_seqlens, and (hidden index, label) of completion tokens.
    Built on the host and sent in one asynchronous copy (see host_to_device)."""
    flat_ids, pos, hidden_idx, labels, cu, offsets = host_layout(sequences)
    ids_t, pos_t, hidden_t, labels_t, cu_t = _to_device(device, flat_ids, pos, hidden_idx, labels, cu)
    return (ids_t.view(1, -1), pos_t.view(1, -1), cu_t.to(torch.int32), hidden_t, labels_t, offsets)


def host_layout(sequences) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """pack_layout's arrays on the host (int64): ids, positions, hidden index, labels, cu_seqlens; and the
    completion offsets."""
    ids: list[int] = []
    prompt_lens, completion_lens = [], []
    for i, (prompt, completion) in enumerate(sequences):
        if not len(prompt):
            raise ValueError(f"sequence {i} has an empty prompt: the first completion token needs a context")
        ids.extend(prompt)
        ids.extend(completion)
        prompt_lens.append(len(prompt))
        completion_lens.append(len(completion))
    p_len = np.asarray(prompt_lens, dtype=np.int64)
    c_len = np.asarray(completion_lens, dtype=np.int64)
    seq_len = p_len + c_len
    cu = np.concatenate([[0], np.cumsum(seq_len)])
    total, n_completion = int(cu[-1]), int(c_len.sum())
    # positions restart at 0 for every sequence
    pos = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], seq_len)
    # Completion token k of sequence i sits at cu[i] + P_i + k and is predicted by the hidden state before it.
    completion_start = np.repeat(cu[:-1] + p_len - 1, c_len)
    offsets = np.concatenate([[0], np.cumsum(c_len)])
    hidden_idx = completion_start + np.arange(n_completion, dtype=np.int64) - np.repeat(offsets[:-1], c_len)
    flat_ids = np.asarray(ids, dtype=np.int64)
    labels = flat_ids[hidden_idx + 1]
    return flat_ids, pos, hidden_idx, labels, cu, offsets.tolist()


def _decoder(model):
    """The transformer body that returns final (normed) hidden states, without the LM head."""
    get = getattr(model, "get_decoder", None)
    body = get() if get is not None else None
    if body is None:
        body = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if body is None or body is model:
        raise TypeError(f"{type(model).__name__}: cannot find the decoder body (expected model.model)")
    return body


@dataclass
class PackedRow:
    """One micro-batch's packed row on the device, built on the host by `pack_row` (layout and one asynchronous
    copy) and run by `packed_forward_logprobs(..., row=...)`. Building it is host work the GPU would wait
    for, so the update builds the next micro-batch's row while the GPU runs the current one's forward."""

    tensors: tuple  # the packed pass's positional inputs: ids, positions, cu (query segments), hidden index, labels
    options: dict[str, Any]  # max_len, and for a shared-prompt row cu_k, kv_index, max_len_k
    offsets: list[int]
    sequences: int  # how many (prompt, completion) pairs
    replay: RouterReplay | None = None  # the engine's recorded routing laid out as the row (train.router_replay)


def pack_row(model, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], *, attn: str = "varlen",
             share_prompts: bool = False, routes: Sequence[Any] | None = None) -> PackedRow | None:
    """The packed row of `sequences` on the model's device (see packed_forward_logprobs for the arguments);
    None for prompts with inputs besides their ids (images), whose row their plug-in's forward builds.
    routes: each sequence's recorded routing (train.router_replay): the row's `replay` (cohort.forward.router_replay)."""
    if attn not in ("varlen", "native"):
        raise ValueError(f"attn={attn!r} is not one of 'varlen', 'native'")
    if not sequences:
        raise ValueError("packed_forward_logprobs got no sequences")
    if has_extra_inputs([prompt for prompt, _ in sequences]):  # prompts with images: their plug-in's forward
        return None
    check_one_sequence(model, len(sequences))  # cohort.forward.recurrent: no state leaking between sequences
    device = model.get_input_embeddings().weight.device
    send = functools.partial(host_to_device, device=device)
    shared = pack_shared_layout(sequences) if share_prompts and _routes_varlen(model, attn) else None
    if shared is not None:
        ids_t, pos_t, cu_q, cu_k, kv_t, hidden_t, labels_t = _to_device(
            device, shared.ids, shared.positions, shared.cu_q, shared.cu_k, shared.kv_index, shared.hidden_idx,
            shared.labels)
        return PackedRow((ids_t.view(1, -1), pos_t.view(1, -1), cu_q.to(torch.int32), hidden_t, labels_t),
                         {"max_len": shared.max_q, "cu_k": cu_k.to(torch.int32), "kv_index": kv_t,
                          "max_len_k": shared.max_k}, shared.offsets, len(sequences),
                         row_replay(routes, sequences, (shared.sources, shared.positions), send))
    input_ids, position_ids, cu, hidden_idx, labels, offsets = pack_layout(sequences, device)
    # the longest sequence, from the host's lists: reading it off `cu` would make the host wait for the GPU
    max_len = max(len(prompt) + len(completion) for prompt, completion in sequences)
    return PackedRow((input_ids, position_ids, cu, hidden_idx, labels), {"max_len": max_len}, offsets,
                     len(sequences), row_replay(routes, sequences, None, send))


def packed_forward_logprobs(
    model,
    sequences: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    attn: str = "varlen",
    lm_head_grad_fp32: bool = True,
    keep_logits: bool = False,
    share_prompts: bool = False,
    row: PackedRow | None = None,
    router_aux_loss: bool = False,
) -> PackedLogprobs:
    """Logprobs (and entropy) of each completion token, all sequences in one padding-free row.

    sequences: (prompt_ids, completion_ids) pairs; prompts must be non-empty, completions may be empty.
    attn: "varlen" (cu_seqlens attention, see module docstring) or "native" (the model's own attention with
    a block-diagonal mask built by transformers from the position ids).
    Gradients flow into the model's parameters; call under torch.no_grad() for old/reference logprobs.
    keep_logits: the logprob kernel keeps the LM-head logits for the backward (cohort.forward.logprobs).
    share_prompts: sequences with the same prompt share one copy of it in the row (cohort.forward.shared_prompts); taken
    when attn="varlen" routes the model's attention through cohort.forward.packed_attention, else the plain row (with a
    warning once when the model's own flash attention is what prevents it).
    row: the row `pack_row` built for these sequences with the same attn and share_prompts (built here if None).
    router_aux_loss: a mixture-of-experts model also returns the router load-balancing loss of the row's tokens
    (`PackedLogprobs.aux_loss`); the plug-in forwards (prompts with images) return none.
    """
    if row is None:
        row = pack_row(model, sequences, attn=attn, share_prompts=share_prompts)
    if row is None:  # prompts with inputs besides their ids (images): the forward their plug-in registered
        forward = row_forward_for(sequences)
        assert forward is not None
        return forward(model, sequences, temperature=temperature, compute_entropy=compute_entropy,
                                      chunk_tokens=chunk_tokens, attn=attn, lm_head_grad_fp32=lm_head_grad_fp32,
                                      keep_logits=keep_logits)
    if row.sequences != len(sequences):
        raise ValueError(f"packed_forward_logprobs: the row was packed for {row.sequences} sequences, got "
                         f"{len(sequences)}")
    # a sharded (FSDP) policy registers the pass as a forward method on its root, so that calling it gathers
    # the root's parameters (embeddings, LM head) and hooks the backward as a root forward would
    run = getattr(model, "cohort_packed_pass", None) or functools.partial(packed_pass, model)
    out = run(*row.tensors, temperature=temperature, compute_entropy=compute_entropy, chunk_tokens=chunk_tokens,
              attn=attn, lm_head_grad_fp32=lm_head_grad_fp32, keep_logits=keep_logits,
              router_aux_loss=router_aux_loss, **row.options)
    packed = PackedLogprobs(out[0], out[1], row.offsets)
    if router_aux_loss:
        packed.aux_loss, packed.row_tokens = out[2], int(row.tensors[0].shape[-1])
    return packed


_WARNED_NO_SHARING: set[int] = set()


def _routes_varlen(model, attn: str) -> bool:
    """Whether the model's packed attention is cohort.forward.packed_attention, which reads the shared-prompt layout.
    Models loaded with a flash-attention implementation read cu_seq_lens themselves and would not gather a
    completion's prompt keys: they keep the plain row, and a warning says so once."""
    if attn != "varlen":
        return False
    enable_packed_attention(model)
    impl = str(model.config._attn_implementation)
    if impl == VARLEN_IMPL:
        return True
    if id(model.config) not in _WARNED_NO_SHARING:
        _WARNED_NO_SHARING.add(id(model.config))
        warnings.warn(f"train.share_prompts: the model's attention implementation {impl!r} packs sequences itself, "
                      "so each completion keeps its own copy of the prompt (correct, slower); load the model with "
                      "model.attn_implementation=sdpa to share prompts", stacklevel=3)
    return False


def packed_pass(model, input_ids, position_ids, cu, hidden_idx, labels, *, temperature: float,
                compute_entropy: bool, chunk_tokens: int, attn: str, lm_head_grad_fp32: bool,
                max_len: int | None = None, keep_logits: bool = False, cu_k=None, kv_index=None,
                max_len_k: int | None = None, router_aux_loss: bool = False, context=None):
    """The decoder body over one packed row, then the chunked logprobs of the labels (model is the root).
    router_aux_loss: also the router load-balancing loss of the row, as a third output.
    context: this rank's share of a context-parallel row (cohort.forward.context_attention.ContextShard): the
    tensors are its tokens, and the logprobs it returns are the whole row's, summed over the group.
    max_len: the longest sequence of the row, when the caller knows it (else read from `cu`, a device sync).
    cu_k, kv_index, max_len_k: the key segments of a shared-prompt row (cohort.forward.shared_prompts); `cu` then marks
    its query segments."""
    kwargs = {}
    if attn == "varlen":
        enable_packed_attention(model)
        prepare_flash(input_ids.device)
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
        if kv_index is not None:
            assert cu_k is not None and max_len_k is not None  # set together by packed_forward_logprobs
            kwargs.update(cu_seq_lens_k=cu_k, max_length_k=max_len_k, cohort_kv_index=kv_index)
        if context is not None:
            kwargs["cohort_context"] = context
    if router_aux_loss:
        kwargs["output_router_logits"] = True
    token = _PACKED_MASKS.set(attn == "varlen")
    try:
        out = _decoder(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
    finally:
        _PACKED_MASKS.reset(token)
    logprobs, entropy = _row_logprobs(model, out, hidden_idx, labels, temperature, compute_entropy, chunk_tokens,
                                      lm_head_grad_fp32, keep_logits)
    if context is not None:
        logprobs, entropy = context.combine(logprobs), None if entropy is None else context.combine(entropy)
    # fresh tensors, not views: FSDP hooks the outputs of a forward method for its backward pre-hook
    result = (logprobs.clone(), None if entropy is None else entropy.clone())
    if router_aux_loss:
        return (*result, router_load_balancing_loss(model, out.router_logits))
    return result


def router_load_balancing_loss(model, router_logits) -> torch.Tensor:
    """The router load-balancing (Switch Transformer) loss of a mixture-of-experts model over every token of its
    router logits (one [tokens, experts] tensor per MoE layer; a packed row has no padding, so no mask), by
    transformers' own `load_balancing_loss_func` of the model's family (Qwen3-MoE's where the family has none)."""
    if not router_logits:
        raise TypeError(f"{type(model).__name__}: router_aux_loss asked, but the model returned no router logits "
                        "(not a mixture-of-experts model?)")
    config = model.config.get_text_config()
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    family = (vars(sys.modules[c.__module__]).get("load_balancing_loss_func") for c in type(model).__mro__
              if c.__module__ in sys.modules)
    func = next((f for f in family if f is not None), load_balancing_loss_func)
    return torch.as_tensor(func(tuple(router_logits), experts, config.num_experts_per_tok, None))


def _row_logprobs(model, out, hidden_idx, labels, temperature: float, compute_entropy: bool, chunk_tokens: int,
                  lm_head_grad_fp32: bool, keep_logits: bool):
    """The chunked logprobs (and entropy) of the labels from the decoder's final hidden states."""
    hidden = out.last_hidden_state[0].index_select(0, hidden_idx)
    weight = model.get_output_embeddings().weight
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap is not None:
        if keep_logits:
            warnings.warn("train.keep_logits has no effect on a model with final-logit soft-capping "
                          f"({type(model).__name__}): its logprobs recompute each chunk's logits in the backward",
                          stacklevel=3)
        return _softcapped_logprobs(hidden, weight, labels, temperature, float(softcap), chunk_tokens,
                                    compute_entropy)
    return selective_logprobs_and_entropy(
        hidden, weight, labels, temperature=temperature, chunk_tokens=chunk_tokens, compute_entropy=compute_entropy,
        lm_head_grad_fp32=lm_head_grad_fp32, keep_logits=keep_logits,
    )


def _softcapped_chunk(hidden, weight, labels, temperature: float, softcap: float, compute_entropy: bool):
    # As Gemma3ForCausalLM.forward: cap the raw logits in their dtype, then log_softmax(logits / T) in fp32.
    logits = hidden @ weight.t()
    logits = torch.tanh(logits / softcap) * softcap
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    chosen = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else torch.zeros_like(chosen)
    return chosen, entropy


def _softcapped_logprobs(hidden, weight, labels, temperature: float, softcap: float, chunk_tokens: int,
                         compute_entropy: bool):
    """Logprobs (and entropy) under final-logit soft-capping, chunk by chunk; each chunk's [n, vocab] logits
    are recomputed in backward (activation checkpointing) instead of kept, so memory stays one chunk."""
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        args = (hidden[start:end], weight, labels[start:end], temperature, softcap, compute_entropy)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            parts.append(checkpoint(_softcapped_chunk, *args, use_reentrant=False))
        else:
            parts.append(_softcapped_chunk(*args))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if compute_entropy else None)
    logprobs = torch.cat([p[0] for p in parts])
    return logprobs, (torch.cat([p[1] for p in parts]) if compute_entropy else None)


def compile_decoder_layers(model, *, dynamic: bool = True, forward_only: bool = False) -> int:
    """torch.compile each decoder layer in place (idempotent); returns how many layers were compiled.

    HF's eager layers launch many small elementwise kernels (RMSNorm in fp32, RoPE, SiLU * up); fusing them
    took a packed forward+backward of Qwen2.5-0.5B on one H100 from 26% to about 40% model-FLOPs
    utilisation (8-17k tokens per micro-batch; the first call compiles for ~8 s). `dynamic=True` keeps
    one graph for every packed length. Meant for CUDA training; generate() through the same layers works
    but recompiles for the KV-cache path. forward_only=True compiles each layer's `forward` and leaves its
    module hooks outside the graph (FSDP's unshard/reshard hooks run eagerly, as torchtitan keeps them).
    """
    layers = getattr(_decoder(model), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: no decoder .layers to compile")
    count = 0
    for layer in layers:
        if not getattr(layer, "_cohort_compiled", False):
            if forward_only:
                layer.forward = torch.compile(layer.forward, dynamic=dynamic)
            else:
                layer.compile(dynamic=dynamic)
            layer._cohort_compiled = True
            count += 1
    return count

"""One copy of a group's prompt in the packed training forward (train.share_prompts).

GRPO trains on G completions of every prompt. The plain packed row `[p c1 p c2 ... p cG]` (cohort.forward.packing) runs
the same prompt through every layer G times, in the forward and in the backward; with a 128-token prompt and
256-token completions that is a third of the update's decoder FLOPs spent on G - 1 identical copies. Here the
row holds each prompt once, followed by the completions that share it:

    tokens     [ p0 p1 p2 | a0 a1 | b0 b1 b2 | q0 q1 r0 ]      (prompt p with completions a, b; q + r alone)
    positions  [ 0  1  2  | 3  4  | 3  4  5  | 0  1  2  ]
    queries    [ p        | a     | b        | q r      ]      segments of cu_seqlens_q
    keys       [ p        | p a   | p b      | q r      ]      rows of `kv_index`, segments of cu_seqlens_k

Attention takes the keys of each query segment through `kv_index` (a gather of the layer's K and V rows), so a
completion sees its prompt and then its own earlier tokens, with the causal mask aligned to the end of its key
segment (query j of a completion of a P-token prompt sees keys 0 .. P + j). Each completion's first token is
predicted from the prompt's last hidden state, the others from the completion's own. The gather's backward adds
the G completions' gradients into the one prompt copy, which is what the G copies would have received: logprobs
and gradients equal the plain layout's up to floating-point summation order (tests/unit/test_shared_prompts.py,
tests/gpu/test_packing_gpu.py). Attention FLOPs are unchanged; the weights' FLOPs of the G - 1 copies are gone.

Only the varlen attention path (`cohort.forward.packed_attention`) understands the layout; `packed_forward_logprobs`
uses it when the model routes attention there, and falls back to the plain row otherwise (see there).
`cohort.forward.micro_batches.split_grouped_micro_batches` keeps a group in one micro-batch where the budget allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SharedLayout:
    """A packed row with shared prompts, on the host: what `pack_shared_layout` sends to the device."""

    ids: np.ndarray  # [T] token ids of the row
    positions: np.ndarray  # [T] position ids (a completion continues after its prompt)
    cu_q: np.ndarray  # [S + 1] query segment boundaries in the row
    cu_k: np.ndarray  # [S + 1] key segment boundaries in kv_index
    kv_index: np.ndarray  # [K] the row's token each key of a segment is
    hidden_idx: np.ndarray  # [N] the row that predicts each completion token (in input order)
    labels: np.ndarray  # [N] the completion tokens
    offsets: list[int]  # input sequence i's tokens are [offsets[i], offsets[i + 1]) of hidden_idx / labels
    sources: np.ndarray  # [T] the input sequence each row's token is of (a shared prompt: its group's first)
    max_q: int
    max_k: int


def prompt_key(prompt) -> tuple[int, ...]:
    """A hashable identity of a prompt's token ids (list, tuple, array or tensor)."""
    return tuple(prompt.tolist()) if hasattr(prompt, "tolist") else tuple(prompt)


def prompt_groups(prompts) -> list[list[int]]:
    """Indices of identical prompts, grouped, in the order of each group's first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt_key(prompt), []).append(i)
    return list(groups.values())


def pack_shared_layout(sequences) -> SharedLayout | None:
    """The shared-prompt row of (prompt_ids, completion_ids) pairs (module docstring); None when no two
    sequences share a prompt (the plain layout is then the same row, without the gather)."""
    prompts = [p for p, _ in sequences]
    groups = prompt_groups(prompts)
    if all(len(g) == 1 for g in groups):
        return None
    completions = [np.asarray(c, dtype=np.int64) for _, c in sequences]  # converted once: rows and labels
    c_len = np.asarray([len(c) for c in completions], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(c_len)])
    hidden_idx = np.empty(int(offsets[-1]), dtype=np.int64)
    ids: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    q_lens: list[int] = []
    keys: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    row = 0

    def segment(tokens: np.ndarray, start_pos: int, key_rows: np.ndarray, source: int) -> int:
        nonlocal row
        ids.append(tokens)
        sources.append(np.full(len(tokens), source, dtype=np.int64))
        positions.append(np.arange(start_pos, start_pos + len(tokens), dtype=np.int64))
        q_lens.append(len(tokens))
        keys.append(key_rows)
        first = row
        row += len(tokens)
        return first

    for group in groups:
        prompt = np.asarray(sequences[group[0]][0], dtype=np.int64)
        p = len(prompt)
        if p == 0:
            raise ValueError(f"sequence {group[0]} has an empty prompt: the first completion token needs a context")
        if len(group) == 1:  # alone: the plain [prompt completion] segment
            i = group[0]
            tokens = np.concatenate([prompt, completions[i]])
            first = segment(tokens, 0, np.arange(row, row + len(tokens), dtype=np.int64), i)
            hidden_idx[offsets[i]:offsets[i + 1]] = first + p - 1 + np.arange(c_len[i])
            continue
        prompt_rows = np.arange(row, row + p, dtype=np.int64)
        segment(prompt, 0, prompt_rows, group[0])
        for i in group:
            if c_len[i] == 0:  # nothing to predict: no segment (a zero-length one would reach the kernels)
                continue
            own = np.arange(row, row + c_len[i], dtype=np.int64)
            first = segment(completions[i], p, np.concatenate([prompt_rows, own]), i)
            # the first completion token is predicted by the prompt's last row, the others by their predecessor
            hidden_idx[offsets[i]] = prompt_rows[-1]
            hidden_idx[offsets[i] + 1:offsets[i + 1]] = first + np.arange(c_len[i] - 1)
    k_lens = np.asarray([len(k) for k in keys], dtype=np.int64)
    flat_ids = np.concatenate(ids)
    labels = np.concatenate(completions)
    return SharedLayout(
        ids=flat_ids, positions=np.concatenate(positions),
        cu_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64),
        cu_k=np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int64),
        kv_index=np.concatenate(keys), hidden_idx=hidden_idx, labels=labels,
        offsets=offsets.tolist(), sources=np.concatenate(sources), max_q=int(max(q_lens)), max_k=int(k_lens.max()),
    )

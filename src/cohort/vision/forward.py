"""The trainer's packed forward for vision-language models: images in, completion logprobs out.

Same contract as `cohort.forward.packing.packed_forward_logprobs` (which hands prompts with images over to here):
every (prompt, completion) pair of a micro-batch sits in one padding-free row, attention never crosses a
sequence boundary (the same cu_seqlens attention on the language model), and only completion tokens are
scored through the chunked logprob kernel. What images add:

- The vision tower runs once per distinct prompt in the micro-batch (the G completions of a prompt share one
  `VisionPrompt` object), through the model's own `get_image_features`; its features replace the embeddings
  at the image-token positions of every sequence of that prompt. Image tokens are context: they are never
  labels, and their embedding rows get no gradient (they are overwritten before the first layer).
- Per-layer embeddings (Gemma 4): the language model also gets `per_layer_inputs` from the row's token ids.
- Positions: each sequence's positions restart at 0. Qwen2-VL / Qwen2.5-VL use multimodal RoPE: the model's
  `get_rope_index` gives each sequence's (temporal, height, width) positions, and the packed row passes
  [4, 1, T] position ids (text positions first, as transformers expects for packed Qwen2-VL inputs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from cohort.forward.logprobs import DEFAULT_CHUNK_TOKENS, selective_logprobs_and_entropy
from cohort.forward.packed_attention import _PACKED_MASKS, enable_packed_attention, prepare_flash
from cohort.forward.packing import PackedLogprobs, pack_layout
from cohort.forward.recurrent import has_recurrent_layers
from cohort.vision.model import image_token_id, inner_model, language_model, unwrap, uses_mrope


def image_features(model, prompt, device) -> torch.Tensor | None:
    """[image tokens, hidden] features of the prompt's images in order (None without images)."""
    inputs = prompt.vision_inputs(device) if getattr(prompt, "num_images", 0) else {}
    if not inputs:
        return None
    out = inner_model(model).get_image_features(**inputs, return_dict=True)
    pooled = out.pooler_output
    return torch.cat(list(pooled), dim=0) if isinstance(pooled, list | tuple) else pooled.reshape(-1, pooled.shape[-1])


def batched_image_features(model, prompts: Sequence, device) -> dict[int, torch.Tensor | None]:
    """id(prompt) -> its image features, for distinct prompts. Prompts whose images come as flattened patches
    with a grid (Qwen2-VL / Qwen2.5-VL: pixel_values [patches, C], image_grid_thw [images, 3]) go through the
    vision tower in one call, as transformers batches them (attention stays within each image); others one
    call per prompt."""
    out: dict[int, torch.Tensor | None] = {}
    grid_style, seen = [], set()
    for prompt in prompts:
        if id(prompt) in seen:
            continue
        seen.add(id(prompt))
        inputs = prompt.vision_inputs(device) if getattr(prompt, "num_images", 0) else {}
        if not inputs:
            out[id(prompt)] = None
        elif set(inputs) == {"pixel_values", "image_grid_thw"}:
            grid_style.append(prompt)
        else:
            out[id(prompt)] = image_features(model, prompt, device)
    if len(grid_style) == 1:
        out[id(grid_style[0])] = image_features(model, grid_style[0], device)
    elif grid_style:
        inputs = [p.vision_inputs(device) for p in grid_style]
        pooled = inner_model(model).get_image_features(
            pixel_values=torch.cat([x["pixel_values"] for x in inputs]),
            image_grid_thw=torch.cat([x["image_grid_thw"] for x in inputs]), return_dict=True).pooler_output
        per_image = iter(pooled)  # one tensor per image, in order
        for prompt, x in zip(grid_style, inputs):
            out[id(prompt)] = torch.cat([next(per_image) for _ in range(x["image_grid_thw"].shape[0])], dim=0)
    return out


def mrope_positions(model, ids: torch.Tensor, prompt) -> torch.Tensor:
    """[3, L] Qwen2-VL positions of one sequence (prompt + completion) from the model's get_rope_index. Only
    the prompt's image tokens (and a tool result's, `image_slots`) are images: one the policy generated is text,
    as in `generate`."""
    inner = inner_model(model)
    slots = torch.tensor(image_slots(prompt, ids.shape[0] - len(prompt)), dtype=torch.bool, device=ids.device)
    token_types = ((ids == image_token_id(model)) & slots).long()[None]
    if not bool(token_types.any()):
        return torch.arange(ids.shape[0], device=ids.device).view(1, -1).expand(3, -1)
    grid = prompt.vision_inputs(ids.device).get("image_grid_thw")
    pos, _ = inner.get_rope_index(ids[None], mm_token_type_ids=token_types, image_grid_thw=grid)
    return pos[:, 0]


def embed_with_images(model, ids: torch.Tensor, prompts: Sequence, owners: Sequence[int],
                      in_prompt: torch.Tensor | None = None) -> torch.Tensor:
    """Token embeddings [1, T, d] of a (packed) row with image features scattered into the image-token
    positions. `owners[k]` is the index in `prompts` of the k-th sequence, in row order; the vision tower runs
    once per distinct prompt object (Qwen-style images of several prompts in one batched call). in_prompt: [T] bools, True on prompt tokens (None: all are): an image
    token the policy generated is an ordinary token, as `generate` treats it."""
    base = unwrap(model)
    embeds = base.get_input_embeddings()(ids[None])
    features = batched_image_features(base, [prompts[k] for k in owners], ids.device)
    ordered = [f for k in owners if (f := features[id(prompts[k])]) is not None]
    mask = ids == image_token_id(base)
    if in_prompt is not None:
        mask = mask & in_prompt
    count = int(mask.sum())
    if not ordered:
        if count:
            raise ValueError(f"{count} image tokens in the row but no images were given")
        return embeds
    feats = torch.cat(ordered, dim=0).to(embeds.dtype)
    if feats.shape[0] != count:
        raise ValueError(f"image features ({feats.shape[0]}) and image tokens ({count}) do not match; the prompt's "
                         "ids and its processor disagree")
    return embeds.masked_scatter(mask[None, :, None], feats)


def per_layer_inputs(model, ids: torch.Tensor, in_prompt: torch.Tensor | None = None) -> dict:
    """The language model's per-layer token embeddings, for models that have them (Gemma 4's `per_layer_inputs`:
    a second embedding of the token ids, which `inputs_embeds` alone cannot give): {"per_layer_inputs": ...}
    for ids [B, T], with image tokens (of the prompt: `in_prompt`, as in `embed_with_images`) read as the pad
    token, as transformers' own forward does; {} for every other model."""
    body = language_model(model)
    get = getattr(body, "get_per_layer_inputs", None)
    if get is None or not getattr(body.config, "hidden_size_per_layer_input", None):
        return {}
    images = ids == image_token_id(model)
    if in_prompt is not None:
        images = images & in_prompt.view_as(ids)
    pad = getattr(body.config, "pad_token_id", None)
    return {"per_layer_inputs": get(torch.where(images, 0 if pad is None else int(pad), ids), None)}


def _pack(sequences, device):
    """The text layout of `pack_layout` (ids and positions as flat vectors), plus which tokens are prompt: image
    tokens are only ever looked for there (a generated image-token id is an ordinary completion token)."""
    in_prompt = [flag for prompt, completion in sequences for flag in image_slots(prompt, len(completion))]
    sequences = [(list(prompt), list(completion)) for prompt, completion in sequences]
    ids, text_pos, cu, hidden_idx, labels, offsets = pack_layout(sequences, device)
    return (ids[0], text_pos[0], cu, hidden_idx, labels, offsets,
            torch.tensor(in_prompt, dtype=torch.bool, device=device))


def image_slots(prompt, completion_len: int) -> list[bool]:
    """Per token of prompt + completion, whether an image token there is an image: every prompt token, and the
    completion positions where a tool result's images sit (`completion_image_positions` of a
    cohort.vision.conversation.VisionSequence); an image-token id the model sampled is text."""
    flags = [True] * len(prompt) + [False] * completion_len
    for k in getattr(prompt, "completion_image_positions", ()):
        flags[len(prompt) + k] = True
    return flags


def vision_packed_logprobs(model, sequences, *, temperature: float = 1.0, compute_entropy: bool = True,
                           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, attn: str = "varlen",
                           lm_head_grad_fp32: bool = True, keep_logits: bool = False):
    """`packed_forward_logprobs` for prompts with images (see the module docstring) -> PackedLogprobs.

    A language model with recurrent layers (Qwen3.5's linear attention) runs one sequence per forward with its
    own attention: in a packed row its state would flow from one sequence into the next (transformers refuses
    packed rows there unless flash-linear-attention is installed, and its causal convolution ignores the
    boundaries even then)."""
    if attn not in ("varlen", "native"):
        raise ValueError(f"attn={attn!r} is not one of 'varlen', 'native'")
    if not sequences:
        raise ValueError("vision_packed_logprobs got no sequences")
    options: dict[str, Any] = dict(temperature=temperature, compute_entropy=compute_entropy,
                                   chunk_tokens=chunk_tokens, lm_head_grad_fp32=lm_head_grad_fp32,
                                   keep_logits=keep_logits)
    if not has_recurrent_layers(language_model(unwrap(model))):  # (cohort.forward.recurrent)
        return _row_logprobs(model, sequences, attn=attn, **options)
    parts = [_row_logprobs(model, [sequence], attn="native", **options) for sequence in sequences]
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + part.offsets[-1])
    entropies = [p.entropy for p in parts if p.entropy is not None]
    entropy = torch.cat(entropies) if len(entropies) == len(parts) else None
    return PackedLogprobs(torch.cat([p.logprobs for p in parts]), entropy, offsets)


def _row_logprobs(model, sequences, *, temperature: float, compute_entropy: bool, chunk_tokens: int, attn: str,
                  lm_head_grad_fp32: bool, keep_logits: bool) -> PackedLogprobs:
    """One packed row of `sequences` through the language model (the module docstring)."""
    base = unwrap(model)
    device = base.get_input_embeddings().weight.device
    ids, text_pos, cu, hidden_idx, labels, offsets, in_prompt = _pack(sequences, device)
    prompts = [p for p, _ in sequences]
    embeds = embed_with_images(base, ids, prompts, range(len(prompts)), in_prompt)
    if uses_mrope(base):
        bounds = cu.tolist()
        rope = torch.cat([mrope_positions(base, ids[a:b], prompts[k])
                          for k, (a, b) in enumerate(itertools.pairwise(bounds))], dim=1)
        position_ids = torch.cat([text_pos[None], rope], dim=0)[:, None, :]  # [4, 1, T]
    else:
        position_ids = text_pos[None]
    body = language_model(base)
    kwargs = {}
    if attn == "varlen":
        enable_packed_attention(body)  # the language model's config: the vision tower keeps its own attention
        prepare_flash(device)
        max_len = int((cu[1:] - cu[:-1]).max())
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    token = _PACKED_MASKS.set(attn == "varlen")
    try:
        out = body(inputs_embeds=embeds, position_ids=position_ids, use_cache=False,
                   **per_layer_inputs(base, ids[None], in_prompt), **kwargs)
    finally:
        _PACKED_MASKS.reset(token)
    hidden = out.last_hidden_state[0].index_select(0, hidden_idx)
    logprobs, entropy = selective_logprobs_and_entropy(
        hidden, base.get_output_embeddings().weight, labels, temperature=temperature, chunk_tokens=chunk_tokens,
        compute_entropy=compute_entropy, lm_head_grad_fp32=lm_head_grad_fp32, keep_logits=keep_logits)
    return PackedLogprobs(logprobs, entropy, offsets)

"""Images inside a multi-turn conversation: a tool that returns an image, on a vision-language model.

A tool may return content blocks (TRL's form: `[{"type": "image", "image": PIL}, {"type": "text", ...}]`). On a
VLM the turn loop renders those tool messages with the processor's chat template and runs the processor over the
continuation text with the images (`encode_image_context`), so the image placeholder is expanded into as many image
tokens as the image has features, exactly as for a prompt's images. Three objects carry the images onward, each a
list of token ids that also knows its images (`cohort.types.PromptWithInputs`), so the text-only layers pass them
through unchanged:

- `ImageContext`: one continuation (tool results and the next assistant header) with its images' tensors;
- `VisionSequence`: ids made of several pieces (the prompt, model turns, continuations): what `generate` is asked
  to continue on the next turn, its images being those of its pieces, in order;
- `ToolImages.training_prompt`: the prompt of a completion whose context holds images, for the update: its ids are
  the prompt's, its images the prompt's then the continuations', and `completion_image_positions` says which
  completion tokens are image tokens of a tool result (an image-token id the model itself sampled stays text, as
  for prompts).

Images concatenate per key along the first dimension, which is how Qwen-style processors lay them out (flattened
patches `pixel_values` [patches, C] and one `image_grid_thw` row per image); processors that stack images per
sample (Idefics3 / SmolVLM) are refused with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_ID_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def _grid_style(tensors: dict[str, torch.Tensor]) -> bool:
    return set(tensors) <= {"pixel_values", "image_grid_thw"}


class ImageContext(list[int]):
    """A continuation's token ids (image tokens expanded) with its images and their processor tensors."""

    def __init__(self, ids: Sequence[int], images: list, tensors: dict[str, torch.Tensor],
                 image_offsets: Sequence[int]):
        super().__init__(int(t) for t in ids)
        self.images = images
        self.tensors = tensors
        self.image_offsets = tuple(image_offsets)  # where its image tokens are, in its own ids

    @property
    def num_images(self) -> int:
        return len(self.images)

    def vision_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        return {k: v.to(device) if device is not None else v for k, v in self.tensors.items()}

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        return self.vision_inputs(device)

    def join_inputs(self, ids: Sequence[int], parts: Sequence[Any]) -> VisionSequence:
        """`ids` (a sequence made of `parts`, among others) carrying the images of `parts`."""
        return VisionSequence(ids, parts)

    def __reduce__(self):
        return (ImageContext, (list(self), self.images, self.tensors, self.image_offsets))


class VisionSequence(list[int]):
    """Token ids whose images are those of `parts` (objects with `vision_inputs`), in order.

    completion_image_positions: for a training prompt, the completion positions that hold a tool result's image
    tokens (the vision forward embeds images there too); () otherwise."""

    def __init__(self, ids: Sequence[int], parts: Sequence[Any], completion_image_positions: Sequence[int] = ()):
        super().__init__(int(t) for t in ids)
        self.parts = [p for p in parts if getattr(p, "num_images", 0)]
        self.completion_image_positions = tuple(completion_image_positions)

    @property
    def num_images(self) -> int:
        return sum(int(p.num_images) for p in self.parts)

    def vision_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        pieces = [p.vision_inputs(device) for p in self.parts]
        pieces = [p for p in pieces if p]
        if not pieces:
            return {}
        if len(pieces) == 1:
            return pieces[0]
        if not all(_grid_style(p) and set(p) == set(pieces[0]) for p in pieces):
            raise ValueError(f"images in several places of one conversation need a processor that lays images out "
                             f"as flattened patches with a grid (Qwen2-VL, Qwen2.5-VL, Qwen3.5); this one gives "
                             f"{sorted(pieces[0])}")
        return {k: torch.cat([p[k] for p in pieces], dim=0) for k in pieces[0]}

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        return self.vision_inputs(device)

    def join_inputs(self, ids: Sequence[int], parts: Sequence[Any]) -> VisionSequence:
        return VisionSequence(ids, parts)

    def __getitem__(self, key):
        if isinstance(key, slice) and (key.start not in (None, 0) or key.stop not in (None, len(self))):
            raise ValueError("a sequence with images cannot be cut (its image tokens would lose their pixels)")
        return super().__getitem__(key)

    def __reduce__(self):
        return (VisionSequence, (list(self), self.parts, self.completion_image_positions))


class ToolImages:
    """The image-carrying continuations of one completion, and where their image tokens sit in it
    (`cohort.types.Completion.context_inputs`)."""

    def __init__(self, contexts: Sequence[ImageContext], positions: Sequence[int]):
        self.contexts = list(contexts)
        self.positions = tuple(positions)

    def training_prompt(self, prompt: Sequence[int]) -> VisionSequence:
        """The completion's prompt for the update: the prompt's ids, its images then the tool results'."""
        return VisionSequence(prompt, [prompt, *self.contexts], self.positions)


def tool_images(contexts: Sequence[Any], completion_ids: Sequence[int],
                mask: Sequence[int] | None) -> ToolImages | None:
    """`ToolImages` for a finished completion whose accepted continuations were `contexts` (in order; each lands as
    one span of mask-0 tokens); None when none of them carries images."""
    if mask is None or not any(getattr(c, "num_images", 0) for c in contexts):
        return None
    spans: list[int] = []  # start of each context span
    for k, m in enumerate(mask):
        if not m and (k == 0 or mask[k - 1]):
            spans.append(k)
    if len(spans) != len(contexts):
        raise RuntimeError(f"the completion has {len(spans)} context spans for {len(contexts)} continuations")
    positions: list[int] = []
    for start, ctx in zip(spans, contexts, strict=True):
        if getattr(ctx, "num_images", 0):
            positions += [start + o for o in ctx.image_offsets]
            if list(completion_ids[start:start + len(ctx)]) != list(ctx):
                raise RuntimeError("a continuation with images is not where its span starts in the completion")
    return ToolImages([c for c in contexts if getattr(c, "num_images", 0)], positions)


def image_token_of(processor) -> int:
    token_id = getattr(processor, "image_token_id", None)
    if isinstance(token_id, int):
        return token_id
    token = getattr(processor, "image_token", None) or "<image>"
    return int(processor.tokenizer.convert_tokens_to_ids(token))


def encode_image_context(processor, text: str, images: list) -> ImageContext | list[int]:
    """A continuation's text (the processor's chat template, image placeholders in it) through the processor with
    the tool results' images: expanded ids and the images' tensors."""
    if not images:
        return list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    out = processor(text=[text], images=[list(images)], return_tensors="pt", add_special_tokens=False)
    tensors = {k: v for k, v in out.items() if k not in _ID_KEYS and isinstance(v, torch.Tensor)}
    if not _grid_style(tensors):
        raise ValueError(f"a tool returned an image, but this processor ({type(processor).__name__}) lays images out "
                         f"as {sorted(tensors)}; images in tool results need a Qwen-style processor (flattened "
                         "patches with a grid: Qwen2-VL, Qwen2.5-VL, Qwen3.5)")
    ids = out["input_ids"][0].tolist()
    image = image_token_of(processor)
    return ImageContext(ids, list(images), tensors, [k for k, t in enumerate(ids) if t == image])


class VisionTurns:
    """What the turn loop (`cohort.agents.TurnLoop.vision`) needs of a VLM's processor: the chat template that
    renders image blocks, the encoding of a continuation with images, and a finished completion's images."""

    def __init__(self, processor) -> None:
        self.processor = processor

    @property
    def renderer(self):
        return self.processor if getattr(self.processor, "chat_template", None) else self.processor.tokenizer

    def encode(self, text: str, images: list) -> ImageContext | list[int]:
        return encode_image_context(self.processor, text, images)

    def completion_inputs(self, contexts: Sequence[Any], completion_ids: Sequence[int],
                          mask: Sequence[int] | None) -> ToolImages | None:
        return tool_images(contexts, completion_ids, mask)

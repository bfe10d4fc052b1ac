"""Prompts with images: reading image columns, placing image parts, and encoding through the processor.

A row may carry `image` (one image) or `images` (a list); an image is a PIL image, a file path, raw bytes, or
the `{"bytes": ..., "path": ...}` dict a `datasets` Image column gives. `encode_vision_dataset` runs the
model's processor (chat template, then the processor, which expands each image placeholder into as many
image tokens as the image has features) on every row once, before training, and keeps per row a
`VisionPrompt`: the token ids (a list, so everything that handles prompt ids handles it), plus the images and
the processor, from which `vision_inputs()` rebuilds the pixel tensors when the engine or the trainer needs
them. Pixel tensors are cached for the most recently used prompts only (a 448x448 image is ~5 MB of fp32
patches; a whole dataset of them would not fit in memory).

Where the image placeholders go (TRL's `prepare_multimodal_messages`): a conversational prompt whose
messages are plain strings gets one `{"type": "image"}` part per image at the start of its first user
message; a prompt whose content is already a list of parts must hold exactly one image part per image; a
text prompt must already contain the processor's image placeholder once per image.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from cohort.data.dataset import EncodeStats, PromptDataset, is_conversational
from cohort.data.images import IMAGE_COLUMNS, row_images
from cohort.errors import DataError
from cohort.vision.conversation import VisionSequence

# Prompts whose pixel tensors stay in memory (the step's prompts are reused by the engine and the update).
_CACHE_SIZE = 256


def has_image_column(dataset: PromptDataset) -> bool:
    return any(c in IMAGE_COLUMNS for c in dataset.column_names)


def load_image(value: Any, source: str, index: int, column: str):
    """A PIL RGB image from a PIL image, a path, bytes, or a datasets {"bytes", "path"} dict; DataError if not."""
    from PIL import Image  # optional dependency (Pillow: prompts with images)

    where = f"Dataset {source!r}: row {index}, column {column!r}"
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
            image = Image.open(io.BytesIO(value["bytes"])) if value.get("bytes") else Image.open(value["path"])
        elif isinstance(value, bytes | bytearray):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, str | os.PathLike):
            if not os.path.isfile(value):
                raise DataError(f"{where}: image file {str(value)!r} does not exist; fix the path (relative paths are "
                                f"read from the working directory {os.getcwd()!r}) or remove the row")
            image = Image.open(value)
        else:
            raise DataError(f"{where}: a {type(value).__name__} is not an image; give a PIL image, a file path, "
                            "bytes, or a datasets Image column")
        image.load()
        return image.convert("RGB")
    except DataError:
        raise
    except Exception as exc:  # PIL raises UnidentifiedImageError, OSError, ValueError, ...
        shown = value if isinstance(value, str | os.PathLike) else type(value).__name__
        raise DataError(f"{where}: cannot read image {str(shown)!r} ({type(exc).__name__}: {exc}); replace the file "
                        "with a readable PNG/JPEG or remove the row") from None


class VisionPrompt(list[int]):
    """A prompt's token ids (image tokens included) that also knows its images.

    It is a list of ints, so PromptBatch, the rollout and the update carry it unchanged; the vision engine and
    the packed forward read `vision_inputs()`. Slicing it is refused: cutting a prompt with images would cut
    image tokens out from under their pixels."""

    def __init__(self, ids, images: list, processor, text: str) -> None:
        super().__init__(int(t) for t in ids)
        self.images = images
        self.processor = processor
        self.text = text  # the rendered prompt, what the processor expanded

    @property
    def num_images(self) -> int:
        return len(self.images)

    def __getitem__(self, key):
        if isinstance(key, slice) and (key.start not in (None, 0) or key.stop not in (None, len(self))):
            raise DataError("a prompt with images cannot be truncated (its image tokens would lose their pixels); "
                            "set data.truncation=drop, or raise data.max_prompt_length / generation.max_model_len")
        return super().__getitem__(key)

    def __reduce__(self):  # pickling (multiprocessing, deepcopy): keep the ids and images
        return (VisionPrompt, (list(self), self.images, self.processor, self.text))

    def join_inputs(self, ids, parts):
        """`ids` (a conversation that starts with this prompt) carrying the images of `parts` (multi-turn)."""
        return VisionSequence(ids, parts)

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """`cohort.types.PromptWithInputs`: what the text-only layers know of this prompt."""
        return self.vision_inputs(device)

    def vision_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The processor's image tensors for this prompt (pixel_values, image_grid_thw, pixel_attention_mask,
        ...), without input ids or masks; {} when the prompt has no image."""
        if not self.images:
            return {}
        key = id(self)
        tensors = _CACHE.get(key)
        if tensors is None or tensors[0] is not self:
            out = self.processor(text=[self.text], images=[self.images], return_tensors="pt")
            ids = [int(t) for t in out["input_ids"][0]]
            if ids != list(self):
                raise RuntimeError("the processor no longer gives this prompt's token ids (was it changed after "
                                   "encoding?)")
            skip = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
            tensors = (self, {k: v for k, v in out.items() if k not in skip and isinstance(v, torch.Tensor)})
            _CACHE[key] = tensors
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
        _CACHE.move_to_end(key)
        return {k: v.to(device) if device is not None else v for k, v in tensors[1].items()}


_CACHE: OrderedDict[int, tuple[VisionPrompt, dict[str, torch.Tensor]]] = OrderedDict()


def _image_token(processor) -> str:
    token = getattr(processor, "image_token", None)
    return token if isinstance(token, str) else "<image>"


def place_image_parts(prompt: Any, num_images: int, source: str, index: int, placeholder: str) -> Any:
    """The prompt with one image placeholder per image (see the module docstring); DataError when a prompt
    that spells its parts out has the wrong number."""
    where = f"Dataset {source!r}: row {index}"
    if isinstance(prompt, str):
        found = prompt.count(placeholder)
        if found != num_images:
            raise DataError(
                f"{where}: the text prompt has {found} image placeholder(s) {placeholder!r} for {num_images} "
                f"image(s). Put {placeholder!r} where each image goes, or load the data as conversational "
                "(data.options.conversational=true) so the chat template places the images")
        return prompt
    if not is_conversational(prompt):
        raise DataError(f"{where}: a prompt must be text or a list of {{role, content}} messages")
    messages = [dict(m) for m in prompt]
    parts_given = [m for m in messages if isinstance(m["content"], list)]
    if parts_given:
        found = sum(1 for m in parts_given for p in m["content"] if isinstance(p, Mapping) and p.get("type") == "image")
        if found != num_images:
            raise DataError(
                f"{where}: the messages hold {found} {{'type': 'image'}} part(s) for {num_images} image(s) in the "
                "image/images column; give one image part per image (or plain string contents, and cohort puts "
                "the images at the start of the first user message)")
    # plain strings become text parts (what multimodal chat templates iterate over)
    for m in messages:
        if isinstance(m["content"], str):
            m["content"] = [{"type": "text", "text": m["content"]}]
    if num_images and not parts_given:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        first = users[0] if users else 0
        messages[first]["content"] = [{"type": "image"} for _ in range(num_images)] + messages[first]["content"]
    return messages


def encode_vision_prompt(processor, prompt: Any, images: list, source: str, index: int,
                         template_kwargs: Mapping[str, Any] | None = None) -> VisionPrompt:
    """Render (chat template) and process one prompt with its loaded images."""
    placed = place_image_parts(prompt, len(images), source, index, _image_token(processor))
    if isinstance(placed, str):
        text = placed
    else:
        if not getattr(processor, "chat_template", None) and not getattr(processor.tokenizer, "chat_template", None):
            raise DataError(f"Dataset {source!r} has conversational prompts but the processor has no chat "
                            "template; set one (processor.chat_template) or use text prompts with the image "
                            "placeholder")
        render = processor if getattr(processor, "chat_template", None) else processor.tokenizer
        text = render.apply_chat_template(placed, add_generation_prompt=True, tokenize=False,
                                          **dict(template_kwargs or {}))
    try:
        out = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    except (ValueError, TypeError, IndexError) as exc:  # placeholder/image count mismatches surface here
        raise DataError(f"Dataset {source!r}: row {index}: the processor rejected the prompt with its "
                        f"{len(images)} image(s) ({exc}); check that each image has one placeholder") from None
    prompt_ids = VisionPrompt(out["input_ids"][0].tolist(), images, processor, text)
    if images:  # the expanded ids are what get_image_features' output is scattered into
        _CACHE[id(prompt_ids)] = (prompt_ids, {k: v for k, v in out.items() if k not in (
            "input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids") and isinstance(v, torch.Tensor)})
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return prompt_ids


def encode_vision_dataset(dataset: PromptDataset, processor, max_prompt_length: int | None = None,
                          truncation: str = "left", chat_template_kwargs: Mapping[str, Any] | None = None,
                          image_token_id: int | None = None) -> PromptDataset:
    """`PromptDataset.encode` for a VLM: every row through the processor with its images (read here, so an
    unreadable file fails before training). A prompt longer than `max_prompt_length` is dropped, whatever
    `truncation` says: cutting it could cut image tokens (counted in stats.num_dropped; the log says so)."""
    stats = EncodeStats(num_prompts=len(dataset.rows), max_prompt_length=max_prompt_length)
    kept_rows: list[dict[str, Any]] = []
    kept_ids: list[list[int]] = []
    for i, row in enumerate(dataset.rows):
        column = "images" if row.get("images") is not None else "image"
        images = [load_image(v, dataset.source, i, column) for v in row_images(row)]
        ids = encode_vision_prompt(processor, row["prompt"], images, dataset.source, i, chat_template_kwargs)
        if images and image_token_id is not None and image_token_id not in ids:
            raise DataError(f"Dataset {dataset.source!r}: row {i}: the encoded prompt holds no image token "
                            f"(id {image_token_id}) for its {len(images)} image(s); the chat template or text "
                            "prompt must keep the image placeholder")
        stats.longest_prompt_tokens = max(stats.longest_prompt_tokens, len(ids))
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            stats.num_dropped += 1
            continue
        kept_rows.append(row)
        kept_ids.append(ids)
    if not kept_rows:
        raise DataError(f"Dataset {dataset.source!r}: all {len(dataset.rows)} prompts (image tokens included) are "
                        f"longer than {max_prompt_length} tokens (longest: {stats.longest_prompt_tokens}) and were "
                        "dropped; raise data.max_prompt_length (or shrink the images in the processor)")
    return PromptDataset(kept_rows, dataset.source, kept_ids, stats)


def check_text_model_data(dataset: PromptDataset, model_name: str) -> None:
    """An image column on a text-only model is an error, not a silently ignored column."""
    for i, row in enumerate(dataset.rows):
        if row_images(row):
            column = "images" if row.get("images") is not None else "image"
            raise DataError(f"Dataset {dataset.source!r}: row {i} has an {column!r} column, but model "
                            f"{model_name!r} is a text-only model (its config has no vision_config). Use a "
                            "vision-language model (Qwen2-VL, Qwen2.5-VL, SmolVLM, ...), or drop the column")

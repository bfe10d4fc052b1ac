"""Vision-language models: image columns, processors, the packed forward with images, and VLM rollouts.

    rows: {"prompt": [...messages...] or text, "image": PIL image / path} or {"images": [...]}
    data = encode_vision_dataset(dataset, processor, max_prompt_length)   # VisionPrompt ids per row
    engine = VisionGroupEngine(policy, processor.tokenizer, eos_token_ids=[...])   # one prefill per group
    packed_forward_logprobs(policy, [(vision_prompt, completion), ...])   # routes here for image prompts

Importing this package registers its training forward (`cohort.forward.plugins`) and its engine family
(`cohort.engine.models.registry`); `cohort.setup` imports it.

See docs/vlm.md for the settings (model.freeze_vision, LoRA on the language model) and what is supported.
"""

from cohort.engine.models.registry import register_family
from cohort.forward.plugins import register_row_forward
from cohort.vision.engine import VisionGroupEngine
from cohort.vision.engine_forward import VisionDecoderForward
from cohort.vision.forward import vision_packed_logprobs
from cohort.vision.inputs import (
    VisionPrompt,
    check_text_model_data,
    encode_vision_dataset,
    encode_vision_prompt,
    has_image_column,
    load_image,
)
from cohort.vision.model import (
    freeze_vision,
    is_vision_model,
    language_model,
    load_vision_policy,
    lora_target_modules,
)

__all__ = [
    "VisionGroupEngine",
    "VisionPrompt",
    "check_text_model_data",
    "encode_vision_dataset",
    "encode_vision_prompt",
    "freeze_vision",
    "has_image_column",
    "is_vision_model",
    "language_model",
    "load_image",
    "load_vision_policy",
    "lora_target_modules",
    "vision_packed_logprobs",
]

# The plug-in's pieces in the layers below it, which never import it: the packed training forward for prompts
# with images, and the paged engine's family for VLMs whose language model is a Llama / Qwen2 decoder.
register_row_forward(vision_packed_logprobs)
register_family(VisionDecoderForward)

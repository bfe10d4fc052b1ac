"""Tiny random-weight vision-language models with processors built offline (no hub).

Three families: Qwen2-VL (multimodal RoPE, patch-merged image tokens), Qwen2.5-VL (the same with a
window-attention vision tower) and Idefics3 (SmolVLM's architecture: a SigLIP-style tower, pixel-shuffle
connector, Llama text model). Each comes with a word-level tokenizer
holding the family's special tokens, a small chat template that renders `{"type": "image"}` parts, and the
family's PIL image processor sized so an image becomes 4 image tokens. Everything is a few tens of thousands
of parameters: forward, generate and a few GRPO steps take well under a second each on the CPU.
"""

from __future__ import annotations

import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = ["what", "colour", "is", "this", "?", "red", "green", "blue", "the", "it", "a", "answer", "with", "one",
         "word", "yes", "no", "cat", "dog", "sky", "grass", "fire", "and", "or", "not", "image", "shows"]
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}

_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
_QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_IDEFICS_SPECIAL = (["<|endoftext|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"]
                    + [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)])
_IDEFICS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %} {{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def _tokenizer(special: list[str], extra: list[str], eos: str) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(special + extra + WORDS + ["[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>")


def qwen2_vl_processor():
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    class _Processor(Qwen2VLProcessor):
        # the video processor needs torchvision, which the test machines lack; images never need it
        @classmethod
        def get_attributes(cls):
            return [a for a in super().get_attributes() if a != "video_processor"]

        video_processor = None

    tok = _tokenizer(_QWEN_SPECIAL, ["user", "assistant", "system"], "<|im_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 4, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    return _Processor(image_processor=images, tokenizer=tok, chat_template=_QWEN_TEMPLATE)


def qwen2_vl(processor, seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": hidden, "num_hidden_layers": layers,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 2 * hidden,
                     "max_position_embeddings": 512, "rope_scaling": {"type": "mrope", "mrope_section": [hidden // 32, hidden // 32, hidden // 16]},
                     "eos_token_id": tok.eos_token_id, "bos_token_id": None, "pad_token_id": tok.pad_token_id},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": hidden, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def qwen2_5_vl(processor, seed: int = 0, hidden: int = 32, layers: int = 2):
    """Qwen2.5-VL: Qwen2-VL's text side and processor layout, a vision tower with window attention."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    cfg = Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok), "hidden_size": hidden, "num_hidden_layers": layers,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 2 * hidden,
                     "max_position_embeddings": 512,
                     "rope_scaling": {"type": "mrope", "mrope_section": [hidden // 32, hidden // 32, hidden // 16]},
                     "eos_token_id": tok.eos_token_id, "bos_token_id": None, "pad_token_id": tok.pad_token_id},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                       "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 56, "fullatt_block_indexes": [1], "in_channels": 3},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def idefics3_processor():
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tok = _tokenizer(_IDEFICS_SPECIAL, ["User:", "Assistant:"], "<end_of_utterance>")
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 32},
                                       max_image_size={"longest_edge": 32})
    return Idefics3Processor(image_processor=images, tokenizer=tok, chat_template=_IDEFICS_TEMPLATE, image_seq_len=4)


def idefics3(processor, seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    tok = processor.tokenizer
    cfg = Idefics3Config(
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": hidden,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "intermediate_size": 2 * hidden, "max_position_embeddings": 512,
                     "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id, "bos_token_id": None},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                       "image_size": 32, "patch_size": 8},
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


FAMILIES = {"qwen2_vl": (qwen2_vl_processor, qwen2_vl), "qwen2_5_vl": (qwen2_vl_processor, qwen2_5_vl),
            "idefics3": (idefics3_processor, idefics3)}


def build(family: str, seed: int = 0, **kwargs):
    """(model, processor) of a tiny random VLM of `family` ('qwen2_vl', 'qwen2_5_vl' or 'idefics3')."""
    make_processor, make_model = FAMILIES[family]
    processor = make_processor()
    return make_model(processor, seed=seed, **kwargs).eval(), processor


def solid(colour: str, size: int = 40) -> Image.Image:
    return Image.new("RGB", (size, size), COLOURS[colour])


def colour_rows(copies: int = 4) -> list[dict]:
    """'what colour is this ?' over solid red/green/blue images; `colour` is the gold word."""
    return [{"prompt": [{"role": "user", "content": "what colour is this ?"}], "image": solid(c), "colour": c}
            for _ in range(copies) for c in COLOURS]

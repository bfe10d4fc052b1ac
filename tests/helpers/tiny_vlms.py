"""Tiny random-weight vision-language models with processors built offline (no hub).

Five families: Qwen2-VL (multimodal RoPE, patch-merged image tokens), Qwen2.5-VL (the same with a
window-attention vision tower), Idefics3 (SmolVLM's architecture: a SigLIP-style tower, pixel-shuffle
connector, Llama text model), Gemma 4 (per-layer token embeddings, 70 pooled soft tokens an image) and Qwen3.5
(a hybrid language model: linear-attention layers with a recurrent state, then full attention). Each comes with a word-level tokenizer
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


_GEMMA4_SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image|>", "<|image>", "<image|>", "<|video|>",
                   "<|audio|>", "<|audio>", "<audio|>"]
_GEMMA4_NAMED = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}
_GEMMA4_TEMPLATE = _QWEN_TEMPLATE.replace("<|im_start|>", "<|turn>").replace("<|im_end|>", "<turn|>").replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|image|>").replace("assistant", "model")


def _without_video(cls):
    """`cls` (a processor taking a video processor) without it: the video processor needs torchvision, which
    the test machines lack; images never need it."""
    class _Processor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return _Processor


def gemma4_processor():
    """Gemma 4: per-layer token embeddings beside the main ones, images as 70 pooled soft tokens."""
    from transformers import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tok = _tokenizer(_GEMMA4_SPECIAL, ["user", "model", "system"], "<turn|>")
    tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token="<turn|>", pad_token="<pad>",
                                  bos_token="<bos>", extra_special_tokens=_GEMMA4_NAMED)
    images = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    return _without_video(Gemma4Processor)(feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=images,
                                            tokenizer=tok, video_processor=None, chat_template=_GEMMA4_TEMPLATE,
                                            image_seq_length=70)


def gemma4(processor, seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    special = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}
    cfg = Gemma4Config(
        text_config={"vocab_size": len(tok), "vocab_size_per_layer_input": len(tok), "hidden_size": hidden,
                     "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                     "global_head_dim": 8, "intermediate_size": 2 * hidden, "hidden_size_per_layer_input": 8,
                     "layer_types": ["sliding_attention", "full_attention"][:layers], "num_kv_shared_layers": 0,
                     "sliding_window": 64, "max_position_embeddings": 512, **special},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 3,
                       "position_embedding_size": 256},
        audio_config=None, image_token_id=ids("<|image|>"), boi_token_id=ids("<|image>"), eoi_token_id=ids("<image|>"),
        video_token_id=ids("<|video|>"), audio_token_id=ids("<|audio|>"), boa_token_id=ids("<|audio>"),
        eoa_token_index=ids("<audio|>"), **special)
    torch.manual_seed(seed)
    return _with_generation_ids(Gemma4ForConditionalGeneration(cfg), tok)


def qwen3_5_processor():
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(_QWEN_SPECIAL, ["user", "assistant", "system"], "<|im_end|>")
    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 4, patch_size=16, merge_size=2,
                                      temporal_patch_size=2)
    return _without_video(Qwen3VLProcessor)(image_processor=images, tokenizer=tok, video_processor=None,
                                            chat_template=_QWEN_TEMPLATE)


def qwen3_5(processor, seed: int = 0, hidden: int = 32, layers: int = 2):
    """Qwen3.5: a hybrid language model (gated delta-net linear attention, then full attention) with
    interleaved multimodal RoPE."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tok = processor.tokenizer
    ids = tok.convert_tokens_to_ids
    special = {"eos_token_id": tok.eos_token_id, "bos_token_id": None, "pad_token_id": tok.pad_token_id}
    cfg = Qwen3_5Config(
        text_config={"vocab_size": len(tok), "hidden_size": hidden, "num_hidden_layers": layers, "head_dim": 8,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 2 * hidden,
                     "layer_types": ["linear_attention", "full_attention"][:layers], "full_attention_interval": 2,
                     "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                     "linear_num_value_heads": 4, "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                         "rope_theta": 10000.0}, **special},
        vision_config={"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": hidden,
                       "patch_size": 16, "num_position_embeddings": 64},
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed)
    return _with_generation_ids(Qwen3_5ForConditionalGeneration(cfg), tok)


def _with_generation_ids(model, tok):
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


FAMILIES = {"qwen2_vl": (qwen2_vl_processor, qwen2_vl), "qwen2_5_vl": (qwen2_vl_processor, qwen2_5_vl),
            "idefics3": (idefics3_processor, idefics3), "gemma4": (gemma4_processor, gemma4),
            "qwen3_5": (qwen3_5_processor, qwen3_5)}


def build(family: str, seed: int = 0, **kwargs):
    """(model, processor) of a tiny random VLM of `family` (a key of FAMILIES)."""
    make_processor, make_model = FAMILIES[family]
    processor = make_processor()
    return make_model(processor, seed=seed, **kwargs).eval(), processor


def solid(colour: str, size: int = 40) -> Image.Image:
    return Image.new("RGB", (size, size), COLOURS[colour])


def colour_rows(copies: int = 4) -> list[dict]:
    """'what colour is this ?' over solid red/green/blue images; `colour` is the gold word."""
    return [{"prompt": [{"role": "user", "content": "what colour is this ?"}], "image": solid(c), "colour": c}
            for _ in range(copies) for c in COLOURS]

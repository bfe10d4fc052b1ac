"""convert_gguf when several processes resolve one GGUF at once (the ranks of a torchrun launch) and when the cache
holds a partial folder: one conversion under the lock, every caller gets the folder, a partial copy is replaced.

A 2-rank `cohort train` of a .gguf model on two H200s failed before step 1: both ranks converted into the same
cache folder and the second rename raised "Directory not empty". The conversion's transformers calls are faked
here (writing the files a real conversion writes); the lock, the rename and the partial-folder check are real.
"""

from __future__ import annotations

import threading
import time

import pytest

from cohort.policy import model as model_mod


class _Fake:
    """Stands in for the model, config and tokenizer classes convert_gguf calls; counts conversions."""

    conversions = 0
    lock = threading.Lock()

    def __init__(self, *args, **kwargs) -> None:
        self.generation_config = None

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    @classmethod
    def from_config(cls, *args, **kwargs):  # once per conversion
        with _Fake.lock:
            _Fake.conversions += 1
        return cls()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None

    def save_pretrained(self, folder) -> None:  # the model's and the tokenizer's
        time.sleep(0.2)  # a real conversion takes seconds: the other caller arrives while this one writes
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"")
        (folder / "tokenizer.json").write_text("{}")


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    for name in ("AutoModelForCausalLM", "AutoTokenizer", "AutoConfig"):
        monkeypatch.setattr(model_mod, name, _Fake)
    monkeypatch.setattr(model_mod, "_with_pad_token", lambda tok: tok)
    monkeypatch.setattr(model_mod, "_check_tokenizer", lambda folder, path: None)
    monkeypatch.setattr(model_mod, "_require_gguf_support", lambda: None)
    _Fake.conversions = 0
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF fake weights")
    return gguf, tmp_path / "cache"


def test_concurrent_callers_convert_once(fake_conversion):
    gguf, cache = fake_conversion
    results, errors = [], []

    def resolve() -> None:
        try:
            results.append(model_mod.convert_gguf(gguf, cache))
        except Exception as exc:  # the test reports whatever a caller raised
            errors.append(exc)

    threads = [threading.Thread(target=resolve) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert len(results) == 3 and len(set(results)) == 1
    assert _Fake.conversions == 1  # the others waited on the lock and found the finished copy
    assert model_mod._is_converted(results[0])
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [results[0].name]  # no temporary folder left


def test_a_partial_folder_is_replaced(fake_conversion):
    gguf, cache = fake_conversion
    target = model_mod.convert_gguf(gguf, cache)
    (target / "config.json").unlink()  # as a conversion cut off by hand or a full disk would leave it
    (target / "stale.bin").write_bytes(b"x")
    assert not model_mod._is_converted(target)
    again = model_mod.convert_gguf(gguf, cache)
    assert again == target and model_mod._is_converted(target)
    assert not (target / "stale.bin").exists()
    assert _Fake.conversions == 2

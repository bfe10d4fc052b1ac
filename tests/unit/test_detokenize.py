"""cohort.data.detokenize.batch_decode gives exactly `tokenizer.batch_decode(ids, skip_special_tokens=True)`, through the
Rust backend's decode_batch only where transformers adds nothing to the backend's text."""

from __future__ import annotations

import copy
import random

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

from cohort.data import detokenize


def _ids(tok, n: int = 12, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    special = list(tok.all_special_ids)
    vocab = len(tok)
    # special tokens in the middle too: skip_special_tokens must drop them on both paths
    return [[rng.choice(special) if rng.random() < 0.05 and special else rng.randrange(vocab) for _ in range(length)]
            for _ in range(n)]


def _spy_backend(tok, monkeypatch) -> list[int]:
    calls: list[int] = []
    real = detokenize._backend

    def backend(t):
        b = real(t)
        if b is not None:
            calls.append(1)
        return b

    monkeypatch.setattr(detokenize, "_backend", backend)
    return calls


def test_tiny_tokenizer_takes_the_backend_and_matches(monkeypatch):
    tok = make_tiny_tokenizer()  # a fresh one per call
    tok.clean_up_tokenization_spaces = False
    calls = _spy_backend(tok, monkeypatch)
    ids = _ids(tok)
    assert detokenize.batch_decode(tok, ids) == tok.batch_decode(ids, skip_special_tokens=True)
    assert calls, "the fast path was not taken"
    assert detokenize._CHECKED[tok] is True


def test_qwen3_tokenizer_matches_batch_decode(monkeypatch):
    from tests.helpers.qwen3_tokenizer import load_qwen3_tokenizer

    tok = copy.deepcopy(load_qwen3_tokenizer())
    calls = _spy_backend(tok, monkeypatch)
    ids = _ids(tok, n=16, length=64, seed=1)
    text_ids = [tok.encode("Hello, world! 1 + 2 = 3.\n  def f(x):\n\treturn x  # ünïcödé 中文 🙂")]
    for batch in (ids, text_ids):
        assert detokenize.batch_decode(tok, batch) == tok.batch_decode(batch, skip_special_tokens=True)
    assert bool(calls) == (not tok.clean_up_tokenization_spaces)


def test_clean_up_spaces_keeps_transformers_decode(monkeypatch):
    tok = make_tiny_tokenizer()  # a fresh one per call
    tok.clean_up_tokenization_spaces = True
    assert detokenize._backend(tok) is None
    ids = _ids(tok)
    assert detokenize.batch_decode(tok, ids) == tok.batch_decode(ids, skip_special_tokens=True)


def test_a_subclass_with_its_own_decode_keeps_it():
    base = make_tiny_tokenizer()

    class Shouting(type(base)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    tok = copy.deepcopy(base)
    tok.__class__ = Shouting
    tok.clean_up_tokenization_spaces = False
    assert detokenize._backend(tok) is None
    ids = _ids(tok)
    assert detokenize.batch_decode(tok, ids) == tok.batch_decode(ids, skip_special_tokens=True)


def test_a_mismatch_turns_the_fast_path_off_for_that_tokenizer(monkeypatch):
    tok = make_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = False

    class Wrong:  # a backend whose text differs from transformers' decode
        def decode_batch(self, ids, skip_special_tokens=True):
            return ["?"] * len(ids)

    monkeypatch.setattr(detokenize, "_backend", lambda t: Wrong())
    ids = _ids(tok)
    want = tok.batch_decode(ids, skip_special_tokens=True)
    assert detokenize.batch_decode(tok, ids) == want
    assert detokenize._CHECKED[tok] is False
    assert detokenize.batch_decode(tok, ids) == want  # off from now on


@pytest.mark.parametrize("ids", [[], [[]], [[], [5, 6]]])
def test_empty_batches_and_completions(ids):
    tok = make_tiny_tokenizer()  # a fresh one per call
    tok.clean_up_tokenization_spaces = False
    assert detokenize.batch_decode(tok, ids) == tok.batch_decode(ids, skip_special_tokens=True)

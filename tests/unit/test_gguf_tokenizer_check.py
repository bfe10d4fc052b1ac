"""convert_gguf refuses a converted tokenizer that splits text into characters (transformers 5.17 built one
from Gemma 3's GGUF): it names the transformers version and the fix, and leaves no cached copy behind."""

from __future__ import annotations

import pytest
import transformers

from cohort.errors import ConfigError
from cohort.policy import model as model_mod


class _Tok:
    def __init__(self, per_char: bool) -> None:
        self.per_char = per_char

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text))) if self.per_char else list(range(len(text.split())))}


@pytest.mark.parametrize("per_char", [True, False])
def test_character_level_tokenizer_is_refused(monkeypatch, tmp_path, per_char):
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda folder: _Tok(per_char))
    if per_char:
        with pytest.raises(ConfigError, match=r"splits text into characters.*transformers"):
            model_mod._check_tokenizer(tmp_path, tmp_path / "m.gguf")
    else:
        model_mod._check_tokenizer(tmp_path, tmp_path / "m.gguf")

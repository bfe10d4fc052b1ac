"""The engine stops on the tokenizer's EOS and on every EOS of the model's generation_config, as `generate` does."""

from types import SimpleNamespace

from cohort.setup.engine import eos_ids


def test_eos_ids_merge_tokenizer_and_generation_config():
    tok = SimpleNamespace(eos_token_id=151643)
    qwen = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[151645, 151643]))
    assert eos_ids(tok, qwen) == [151643, 151645]
    assert eos_ids(tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=2))) == [2, 151643]
    assert eos_ids(tok) == [151643]
    assert eos_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace()) == []

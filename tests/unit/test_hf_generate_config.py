"""generation.hf_generate_kwargs: transformers GenerationConfig options for engine=hf, refused before any model
loads with the field, the key and the fix when cohort's engine would run, when cohort owns the option, or when the
name is not a GenerationConfig option."""

from __future__ import annotations

import pytest
from tests.helpers.toy_task import toy_rows

from cohort.config import CohortConfig
from cohort.errors import ConfigError


def _cfg(engine: str, **kwargs) -> CohortConfig:
    cfg = CohortConfig()
    cfg.data.source = toy_rows
    cfg.generation.engine = engine
    cfg.generation.hf_generate_kwargs = kwargs
    return cfg


def test_beam_options_are_accepted_for_the_hf_engine():
    _cfg("hf", num_beams=2, length_penalty=-0.1, no_repeat_ngram_size=3).validate()
    _cfg("auto").validate()  # empty: nothing to check


@pytest.mark.parametrize(("engine", "kwargs", "fragments"), [
    ("auto", {"num_beams": 2}, ("generation.hf_generate_kwargs", "generation.engine='auto'", "set generation.engine=hf")),
    ("hf", {"temperature": 0.5}, ("generation.hf_generate_kwargs['temperature']", "use generation.temperature")),
    ("hf", {"max_new_tokens": 9}, ("use generation.max_completion_length",)),
    ("hf", {"num_beam": 2}, ("['num_beam'] is not a transformers GenerationConfig option", "did you mean 'num_beams'")),
    ("hf", {"num_beams": 0}, ("['num_beams']=0", "positive whole number")),
    ("hf", {"length_penalty": [1]}, ("['length_penalty']=[1]", "a number, a string")),
])
def test_bad_entries_name_the_field_key_and_fix(engine, kwargs, fragments):
    with pytest.raises(ConfigError) as info:
        _cfg(engine, **kwargs).validate()
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)

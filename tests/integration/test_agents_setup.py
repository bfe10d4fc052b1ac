"""model.chat_template reaches the tokenizer before prompts are rendered (recipe key and dotted override)."""

from __future__ import annotations

import json

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, tiny_model

from cohort.agents.templates import CHATML_TOOLS, check_renders_tools
from cohort.config import CohortConfig, apply_overrides
from cohort.errors import ConfigError
from cohort.rewards import RewardRunner
from cohort.setup import build_components


def _cfg(tmp_path, *overrides):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {d}"}], "digit": str(d)})
                              for d in range(4)))
    cfg = apply_overrides(CohortConfig(), [f"data.source={rows}", "data.system_prompt=Be brief.",
                                           f"run.output_dir={tmp_path / 'run'}", "run.report_to=[jsonl]",
                                           "generation.num_generations=2", "train.prompts_per_step=2",
                                           "generation.max_completion_length=16", *overrides])  # tiny model: 256 ctx
    return cfg


def test_chat_template_option_is_applied_before_prompts_are_encoded(tmp_path):
    tok = make_tiny_tokenizer()
    cfg = _cfg(tmp_path, "model.chat_template=chatml_tools")
    comp = build_components(cfg, policy=tiny_model(tok), tokenizer=tok, reward_runner=RewardRunner([digit_share]),
                            echo=lambda *a: None)
    assert comp.tokenizer.chat_template == CHATML_TOOLS
    check_renders_tools(comp.tokenizer)
    first = comp.tokenizer.decode(comp.train_data.prompt_ids[0])
    assert first == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay 0<|im_end|>\n<|im_start|>assistant\n"


def test_unknown_chat_template_is_a_config_error(tmp_path):
    tok = make_tiny_tokenizer()
    with pytest.raises(ConfigError, match="chatml_tools"):
        build_components(_cfg(tmp_path, "model.chat_template=nope"), policy=tiny_model(tok), tokenizer=tok,
                         reward_runner=RewardRunner([digit_share]), echo=lambda *a: None)

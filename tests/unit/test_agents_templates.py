"""The chatml_tools template, the model.chat_template option, the tools check, and continuation ids."""

from __future__ import annotations

import json

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer

from cohort.agents.builtins import calculator
from cohort.agents.messages import (
    assistant_message,
    continuation_ids,
    continuation_text,
    tool_result_messages,
)
from cohort.agents.parsing import parse_tool_calls
from cohort.agents.templates import (
    CHATML_TOOLS,
    apply_chat_template_override,
    check_renders_tools,
    renders_tools,
    resolve_chat_template,
)
from cohort.agents.tools import ToolResult, ToolRunner, build_tools, tool_schemas
from cohort.config import CohortConfig, apply_overrides
from cohort.errors import ConfigError

TOOLS = build_tools([calculator])
CALL = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


@pytest.fixture
def tok():
    return apply_chat_template_override(make_tiny_tokenizer(), "chatml_tools")


def render(tok, messages, gen=True, tools=TOOLS):
    return tok.apply_chat_template(messages, tools=tool_schemas(tools) or None, tokenize=False,
                                   add_generation_prompt=gen)


def test_renders_the_tools_in_a_system_block(tok):
    text = render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    tools_json = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_json) == TOOLS[0].schema
    assert text.endswith("<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert "<tool_call>" in text  # the instructions show the call format


def test_plain_chatml_without_tools(tok):
    text = render(tok, [{"role": "user", "content": "hi"}], tools=[])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_renders_calls_and_results_that_parse_back(tok):
    calls = parse_tool_calls(CALL)
    results = ToolRunner(TOOLS).run(calls)
    msgs = [{"role": "user", "content": "2+3?"}, assistant_message(CALL, calls), *tool_result_messages(results)]
    text = render(tok, msgs)
    assert ("<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
            '{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    assistant_turn = text.split("<|im_start|>assistant\n")[-2]
    assert parse_tool_calls(assistant_turn) == calls


def test_consecutive_tool_results_share_one_turn(tok):
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1"}}},
                {"name": "calculator", "arguments": '{"expression": "2"}'}]},
            {"role": "tool", "name": "calculator", "content": "1"},
            {"role": "tool", "name": "calculator", "content": "2"}]
    text = render(tok, msgs, gen=False)
    assert text.count("<tool_call>") == 4  # 2 in the instructions, 2 calls
    assert '"arguments": {"expression": "2"}' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
                         "</tool_response><|im_end|>\n")


def test_check_renders_tools():
    plain = make_tiny_tokenizer()  # ChatML without tools: ignores `tools` and `tool_calls`
    assert "tool list" in renders_tools(plain)
    with pytest.raises(ConfigError, match=r"model\.chat_template=chatml_tools"):
        check_renders_tools(plain)
    check_renders_tools(apply_chat_template_override(plain, "chatml_tools"))
    bare = make_tiny_tokenizer()
    bare.chat_template = None
    assert "no chat template" in renders_tools(bare)


def test_chat_template_option(tmp_path):
    assert resolve_chat_template("chatml_tools") == CHATML_TOOLS
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    tok = apply_chat_template_override(make_tiny_tokenizer(), str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False) == "abc"
    kept = make_tiny_tokenizer()
    assert apply_chat_template_override(kept, None).chat_template == make_tiny_tokenizer().chat_template
    with pytest.raises(ConfigError, match="chatml_tools"):
        resolve_chat_template("no_such_template")
    cfg = apply_overrides(CohortConfig(), ["model.chat_template=chatml_tools"])
    assert cfg.model.chat_template == "chatml_tools" and CohortConfig().model.chat_template is None


def test_continuation_is_exactly_the_suffix(tok):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    calls = parse_tool_calls(CALL)
    results = ToolRunner(TOOLS).run(calls)
    so_far = [*conv, assistant_message(CALL, calls)]
    new = tool_result_messages(results)
    ids = continuation_ids(tok, so_far, new, TOOLS)
    expected = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == expected
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    # prompt + the model's turn (up to its <|im_end|>) + continuation == the template's whole conversation
    prompt = render(tok, conv)
    model_turn = render(tok, so_far, gen=False)[len(prompt):].rsplit("\n", 1)[0]
    assert model_turn.endswith("<|im_end|>")
    assert prompt + model_turn + tok.decode(ids) == render(tok, so_far + new)
    # a completion stopped before <|im_end|>: the continuation starts with it
    closed = continuation_ids(tok, so_far, new, TOOLS, close_turn=True)
    assert tok.decode(closed) == "<|im_end|>" + expected


def test_continuation_second_turn(tok):
    conv = [{"role": "user", "content": "q"}, assistant_message(CALL, parse_tool_calls(CALL)),
            *tool_result_messages([ToolResult("calculator", "5")])]
    call2 = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5 * 2"}}\n</tool_call>'
    so_far = [*conv, assistant_message(call2, parse_tool_calls(call2))]
    text = continuation_text(tok, so_far, tool_result_messages([ToolResult("calculator", "10")]), TOOLS)
    assert text == "\n<|im_start|>user\n<tool_response>\n10\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_continuation_falls_back_when_history_is_rerendered():
    """A template that keeps reasoning only in the last assistant turn re-renders history once messages follow;
    the continuation then comes from the stand-in conversation (user + the tool-calling assistant message)."""
    tok = make_tiny_tokenizer()
    tok.chat_template = (
        "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.index0 != ns.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    so_far = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>a</think>call 1"},
              {"role": "tool", "content": "5"}, {"role": "assistant", "content": "<think>b</think>call 2"}]
    new = [{"role": "tool", "content": "10"}]
    full = tok.apply_chat_template(so_far + new, tokenize=False, add_generation_prompt=True)
    assert not full.startswith(tok.apply_chat_template(so_far[:-1], tokenize=False))  # history re-rendered
    text = continuation_text(tok, so_far, new)
    assert text == "\n<|im_start|>tool\n10<|im_end|>\n<|im_start|>assistant\n"
    assert full.endswith(text)


def test_continuation_needs_the_assistant_message(tok):
    with pytest.raises(ValueError, match="assistant"):
        continuation_ids(tok, [{"role": "user", "content": "q"}], [{"role": "tool", "content": "1"}], TOOLS)


def test_assistant_message_drops_calls_and_end_of_turn():
    text = CALL + "<|im_end|>"
    msg = assistant_message(text, parse_tool_calls(text))
    assert msg == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}]}
    assert assistant_message("The answer is 5.<|im_end|>") == {"role": "assistant", "content": "The answer is 5."}

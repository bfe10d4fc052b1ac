"""Tool-call parsing: the ChatML/Qwen format, several calls, malformed calls, and the tokenizer's own parser."""

from __future__ import annotations

from cohort.agents.parsing import parse_tool_calls
from cohort.agents.tools import ToolCall, ToolRunner

ONE = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 30"}}\n</tool_call>'


def test_single_call():
    assert parse_tool_calls(ONE) == [ToolCall("calculator", {"expression": "12 + 30"})]


def test_no_call():
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("") == []


def test_several_calls_in_order():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
            '<tool_call>\n{"name": "c", "arguments": "{\\"y\\": [1, 2]}"}\n</tool_call><|im_end|>')
    assert parse_tool_calls(text) == [ToolCall("a", {"x": 1}), ToolCall("b", {}), ToolCall("c", {"y": [1, 2]})]


def test_openai_style_and_missing_arguments():
    text = ('<tool_call>{"type": "function", "function": {"name": "f", "arguments": {"k": "v"}}}</tool_call>'
            '<tool_call>{"name": "g"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("f", {"k": "v"}), ToolCall("g", {})]


def test_malformed_calls_become_invalid_calls():
    text = ('<tool_call>\n{"name": "calculator", "arguments": {expression: 1+1}}\n</tool_call>'
            '<tool_call>["calculator"]</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
    calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["__invalid__"] * 4
    assert "expression: 1+1" in calls[0].arguments["raw"] and "JSON" in calls[0].arguments["error"]
    results = ToolRunner([]).run(calls)
    assert all(r.failed and "could not parse" in r.content for r in results)


def test_valid_and_invalid_mixed():
    text = ONE + '\n<tool_call>{"name": oops}</tool_call>'
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "12 + 30"}) and calls[1].name == "__invalid__"


def test_unclosed_last_call_is_read():
    text = 'x <tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "1"})]
    assert parse_tool_calls('x <tool_call>\n{"name": "calc')[0].name == "__invalid__"


def test_calls_inside_reasoning_are_ignored():
    text = '<think>maybe <tool_call>{"name": "a", "arguments": {}}</tool_call></think>\n' + ONE
    assert [c.name for c in parse_tool_calls(text)] == ["calculator"]
    assert parse_tool_calls('<think>still thinking <tool_call>{"name": "a"}</tool_call>') == []


class _ParsingTokenizer:
    """A tokenizer with a response template: parse_tool_calls must use its parse_response."""

    response_template = "set"  # any non-None value marks a tokenizer with a response parser

    def __init__(self, message):
        self.message = message
        self.calls = 0

    def parse_response(self, text, schema=None, *, prefix=None, tools=None):
        self.calls += 1
        return self.message


def test_tokenizer_parser_is_preferred():
    tok = _ParsingTokenizer({"role": "assistant", "content": "",
                             "tool_calls": [{"type": "function", "function": {"name": "m", "arguments": {"a": 1}}}]})
    assert parse_tool_calls("anything", tok) == [ToolCall("m", {"a": 1})] and tok.calls == 1


def test_tokenizer_parser_failure_falls_back():
    class Raising(_ParsingTokenizer):
        def parse_response(self, *a, **k):
            raise ValueError("cannot parse")

    assert parse_tool_calls(ONE, Raising(None)) == [ToolCall("calculator", {"expression": "12 + 30"})]
    # a parser that misses the block (no tool_calls) -> the ChatML parser reads it
    assert parse_tool_calls(ONE, _ParsingTokenizer({"role": "assistant", "content": ONE}))[0].name == "calculator"


def test_tokenizer_without_template_uses_chatml_parser():
    class Plain:
        def parse_response(self, *a, **k):  # pragma: no cover - must not be called
            raise AssertionError

    assert parse_tool_calls(ONE, Plain()) == [ToolCall("calculator", {"expression": "12 + 30"})]


def test_the_xml_calls_of_qwen3_5_and_qwen3_coder_templates():
    text = ("<tool_call>\n<function=calculator>\n<parameter=expression>\n12 + 30\n</parameter>\n"
            "<parameter=digits>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>")
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "12 + 30", "digits": 3})]
    assert parse_tool_calls("<tool_call>\n<function=screenshot>\n</function>\n</tool_call>") == [
        ToolCall("screenshot", {})]
    bad = parse_tool_calls("<tool_call><function=calc</tool_call>")
    assert bad[0].name == "__invalid__" and "function=name" in bad[0].arguments["error"]

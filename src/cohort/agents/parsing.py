"""Read the tool calls out of a model's completion.

`parse_tool_calls(text, tokenizer)` first asks the tokenizer: transformers 5.x tokenizers may carry a
`response_template` (older releases: `response_schema`) and then `tokenizer.parse_response(text)` returns the
assistant message with its `tool_calls`. Most tokenizers carry none today, so the fallback is a parser for the
format of Qwen2.5, Qwen3, Hermes and our `chatml_tools` template:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 + 30"}}
    </tool_call>

Several blocks per message are allowed; `<think>...</think>` reasoning is skipped. A block whose body is not a
JSON object with a string `name` (and an object, or a JSON string of an object, as `arguments`) becomes
`ToolCall("__invalid__", {"raw": body, "error": why})`: the runner answers it with an error message, and it
counts as a failed call. A last `<tool_call>` left open (generation stopped at a `</tool_call>` stop string)
is read the same way.

The XML body of Qwen3-Coder and Qwen3.5 templates is read too (a parameter's value as JSON when it parses, else
the text):

    <tool_call>
    <function=calculator>
    <parameter=expression>
    12 + 30
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import json
import re
from typing import Any

from cohort.agents.tools import INVALID_TOOL_NAME, ToolCall, tool_schemas

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_tool_calls(text: str, tokenizer: Any = None, *, tools: Any = None) -> list[ToolCall]:
    """The tool calls in one assistant completion, in order; [] when it makes none.

    `tools` (Tools or schemas) is passed to the tokenizer's parser, which then casts arguments to their types.
    """
    if tokenizer is not None and _has_response_parser(tokenizer):
        calls = _parse_with_tokenizer(text, tokenizer, tools)
        if calls is not None:
            return calls
    return parse_chatml_tool_calls(text)


def has_tool_call(text: str) -> bool:
    return TOOL_CALL_OPEN in _THINK.sub("", text)


def parse_chatml_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>{json}</tool_call>` parser (Qwen2.5/Qwen3/Hermes/ChatML)."""
    text = _THINK.sub("", text)
    if "<think>" in text:  # reasoning never closed: nothing after it is a call
        text = text.split("<think>", 1)[0]
    calls = [_call_from_body(m.group(1)) for m in _BLOCK.finditer(text)]
    tail = text[text.rfind(TOOL_CALL_CLOSE) + len(TOOL_CALL_CLOSE):] if TOOL_CALL_CLOSE in text else text
    if TOOL_CALL_OPEN in tail:
        calls.append(_call_from_body(tail.split(TOOL_CALL_OPEN, 1)[1]))
    return calls


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _call_from_body(body: str) -> ToolCall:
    raw = body.strip()
    if raw.startswith("<function="):
        return _call_from_xml(raw)
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return _invalid(raw, f"not valid JSON: {exc.msg} at character {exc.pos}")
    return _call_from_obj(obj, raw)


def _call_from_obj(obj: Any, raw: str) -> ToolCall:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    if not isinstance(obj, dict):
        return _invalid(raw, "the call must be a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _invalid(raw, "the call has no 'name' string")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return _invalid(raw, "'arguments' is a string that is not a JSON object")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _invalid(raw, "'arguments' must be a JSON object")
    return ToolCall(name=name, arguments=args)


def _call_from_xml(raw: str) -> ToolCall:
    """`<function=name><parameter=key>value</parameter>...</function>` (Qwen3-Coder, Qwen3.5)."""
    m = _XML_FUNCTION.match(raw)
    if m is None:
        return _invalid(raw, "a <function=name> block must name its function and close with </function>")
    args: dict[str, Any] = {}
    for key, value in _XML_PARAMETER.findall(m.group(2)):
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    return ToolCall(name=m.group(1), arguments=args)


def _invalid(raw: str, why: str) -> ToolCall:
    return ToolCall(name=INVALID_TOOL_NAME, arguments={"raw": raw, "error": why})


def _has_response_parser(tokenizer: Any) -> bool:
    if not callable(getattr(tokenizer, "parse_response", None)):
        return False
    return (getattr(tokenizer, "response_template", None) is not None
            or getattr(tokenizer, "response_schema", None) is not None)


def _parse_with_tokenizer(text: str, tokenizer: Any, tools: Any) -> list[ToolCall] | None:
    """Calls from `tokenizer.parse_response`; None when it fails (then the ChatML parser reads the text)."""
    kwargs = {"tools": tool_schemas(tools)} if tools else {}
    try:
        try:
            message = tokenizer.parse_response(text, prefix="", **kwargs)
        except TypeError:  # releases before `prefix=` / `tools=` existed
            message = tokenizer.parse_response(text)
    except Exception:
        return None
    if not isinstance(message, dict):
        return None
    calls = []
    for tc in message.get("tool_calls") or []:
        if isinstance(tc, dict):
            calls.append(_call_from_obj(tc, json.dumps(tc, default=str)))
        else:
            calls.append(_invalid(str(tc), "the tokenizer's parser returned a call that is not an object"))
    if not calls and has_tool_call(text):
        return None  # the template did not see the block; let the ChatML parser report it
    return calls

"""A ChatML chat template that renders tools, tool calls and tool results, and the `model.chat_template` option.

Models whose own template ignores `tools` (SmolLM2-135M-Instruct's, for one) can be given ours with
`model.chat_template: chatml_tools`, or any jinja file with `model.chat_template: path/to/template.jinja`.
`chatml_tools` renders

    <|im_start|>system
    {system prompt, if any}

    You can call functions. Their signatures are listed as JSON inside <tools></tools>:
    <tools>
    {"type": "function", "function": {...}}
    </tools>
    To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:
    <tool_call>
    {"name": "<function name>", "arguments": {"<argument>": <value>}}
    </tool_call><|im_end|>
    <|im_start|>user
    ...<|im_end|>
    <|im_start|>assistant
    {content}
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    5
    </tool_response><|im_end|>
    <|im_start|>assistant

Consecutive tool results share one user turn, one `<tool_response>` block each, as Qwen2.5 does, so
`cohort.agents.parsing` reads the calls back. It uses only `<|im_start|>` / `<|im_end|>` as special tokens:
any ChatML tokenizer (SmolLM2, Qwen) has them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cohort.errors import ConfigError

CHATML_TOOLS = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_text = messages[0]['content'] -%}{%- set body = messages[1:] -%}"
    "{%- else -%}{%- set system_text = none -%}{%- set body = messages -%}{%- endif -%}"
    "{%- if tools or system_text is not none -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system_text is not none -%}{{- system_text -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if system_text -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can call functions. Their signatures are listed as JSON inside <tools></tools>:\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nTo call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": \"<function name>\", \"arguments\": "
    "{\"<argument>\": <value>}}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in body -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' -}}{{- message['content'] -}}{{- '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if call['function'] is defined -%}{%- set call = call['function'] -%}{%- endif -%}"
    "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' -}}{{- call['name'] | tojson -}}{{- ', \"arguments\": ' -}}"
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}"
    "{%- else -%}{{- call['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

BUILTIN_TEMPLATES = {"chatml_tools": CHATML_TOOLS}


def resolve_chat_template(value: str) -> str:
    """The jinja text for `model.chat_template`: a built-in name or a path to a .jinja file."""
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{%" in value or "{{" in value:
        return value  # the template text itself (GRPOConfig users sometimes pass it inline)
    raise ConfigError(
        f"model.chat_template={value!r} is neither a built-in template ({', '.join(sorted(BUILTIN_TEMPLATES))}) "
        "nor an existing .jinja file; use model.chat_template=chatml_tools or give the path of a template file."
    )


def apply_chat_template_override(tokenizer: Any, value: str | None) -> Any:
    """Set `tokenizer.chat_template` from `model.chat_template` (None: keep the tokenizer's own). Returns it."""
    if value:
        tokenizer.chat_template = resolve_chat_template(value)
    return tokenizer


_NAME, _KEY, _VAL, _CONTENT = "tool_name_7f3a", "arg_key_2c9d", "arg_val_5e1b", "tool_result_9b4c"


def renders_tools(tokenizer: Any) -> str | None:
    """None when the chat template renders a tool-calling exchange in full, else what it gets wrong."""
    if not getattr(tokenizer, "chat_template", None):
        return "the tokenizer has no chat template"
    schema = {"type": "function", "function": {"name": _NAME, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": _NAME, "arguments": {_KEY: _VAL}}}]},
        {"role": "tool", "name": _NAME, "content": _CONTENT},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False, add_generation_prompt=True)
        bare = tokenizer.apply_chat_template(messages[:1], tools=[schema], tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        return f"rendering a tool-calling conversation fails ({type(exc).__name__}: {exc})"
    missing = [what for what, s in (("the tool call's name", _NAME), ("its arguments", _VAL),
                                    ("the tool result", _CONTENT)) if s not in text]
    if _NAME not in bare:
        missing.insert(0, "the tool list")
    return f"it does not render {', '.join(missing)}" if missing else None


def check_renders_tools(tokenizer: Any) -> None:
    """ConfigError naming the fix when the tokenizer's chat template cannot render tools, calls and results."""
    problem = renders_tools(tokenizer)
    if problem is not None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"the chat template of {name!r} cannot be used with tools: {problem}. Give the model a template that "
            "renders tools: model.chat_template=chatml_tools (cohort's ChatML-with-tools template; in GRPOConfig "
            "extra={'model.chat_template': 'chatml_tools'}), or model.chat_template=path/to/template.jinja."
        )

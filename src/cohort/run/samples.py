"""A step's sample rows as samples.jsonl stores them: prompts and cells made JSON-safe and kept short."""

from __future__ import annotations

from typing import Any

import numpy as np


def sample_prompt(prompt: Any, keep: int = 500) -> Any:
    """A prompt as samples.jsonl stores it: plain text (its last `keep` characters), or, when conversational,
    the messages as a JSON list of {role, content} (each content's last `keep` characters)."""
    if isinstance(prompt, str):
        return prompt[-keep:]
    if isinstance(prompt, list | tuple) and all(isinstance(m, dict) for m in prompt):
        messages = []
        for m in prompt:
            content = m.get("content")
            row = {"role": str(m.get("role", "")),
                   "content": content[-keep:] if isinstance(content, str) else json_safe(content)}
            messages.append({**{k: json_safe(v) for k, v in m.items() if k not in ("role", "content")}, **row})
        return messages
    return str(prompt)[-keep:]


def json_safe(value: Any) -> Any:
    """Nested lists and dicts of JSON cells (multimodal content parts, tool calls); anything else as text."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return cell(value)


def cell(value: Any) -> Any:
    """A JSON-safe sample cell: strings, ints and finite floats as they are, anything else as text."""
    ok = isinstance(value, str | int | bool) or (isinstance(value, float) and np.isfinite(value)) or value is None
    return value if ok else str(value)

"""Turn tool results into chat messages and into the token ids that continue the model's sequence.

A multi-turn rollout is one token sequence: prompt, the model's first completion (ending in its end-of-turn
token, e.g. `<|im_end|>`), then the tokens of the tool results and the next assistant header, then the model's
next completion, and so on. `continuation_ids` computes the middle part from the chat template, so the sequence
is exactly what the template would render for the whole conversation, without re-tokenising what the model
wrote (its own tokens stay as sampled, which the logprobs need).

How: render the conversation so far (ending with the assistant's tool-calling message) without, and the same
conversation plus the new tool messages with `add_generation_prompt=True`; the continuation is the text of the
second after the first, cut back to just after the assistant's end-of-turn marker (the model stopped there; a
template's newline after it belongs to the continuation). Some templates render the last assistant message
differently once messages follow it (Qwen3 writes an empty `<think></think>` into the final assistant turn
only), so the first rendering is not a prefix of the second; then the cut is made in the second rendering
itself, at the first end-of-turn marker after the history that precedes the assistant message (rendered
identically in both). If even that history is re-rendered differently, the tool messages are rendered after a
minimal stand-in conversation (a user message and the assistant's tool-calling message), which is what TRL
does for every turn. ChatML, Qwen2.5, Qwen3 (thinking on or off) and `chatml_tools` give the same tokens on
every path; the tests check Qwen3 and `chatml_tools`.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Sequence
from typing import Any

from cohort.agents.parsing import _BLOCK, TOOL_CALL_OPEN
from cohort.agents.tools import Tool, ToolCall, ToolResult, tool_schemas
from cohort.errors import ConfigError

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


def tool_result_messages(results: Sequence[ToolResult], with_images: bool = False) -> list[dict[str, Any]]:
    """One `{"role": "tool", "name": ..., "content": ...}` message per result, in order.

    A result with images (a tool that returned content blocks): with_images (a vision-language model) makes its
    content the blocks, `{"type": "image"}` where each image goes (the processor's chat template renders the
    placeholder, the processor expands it); otherwise the text says how many images the text-only model does not
    see, rather than dropping them silently."""
    out = []
    for r in results:
        content: Any = r.content
        if r.images and with_images:
            content = [{"type": "image"} if kind == "image" else {"type": "text", "text": value}
                       for kind, value in r.parts]
        elif r.images:
            content = f"{r.content}\n[{len(r.images)} image(s) returned by the tool; this model reads text only]"
        out.append({"role": "tool", "name": r.name, "content": content})
    return out


def assistant_message(text: str, calls: Sequence[ToolCall] = (), tokenizer: Any = None) -> dict[str, Any]:
    """The assistant message for a completion: its text without the tool-call blocks and without the trailing
    end-of-turn token (`<|im_end|>`, the tokenizer's EOS), plus `tool_calls`."""
    content = _BLOCK.sub("", text)
    if TOOL_CALL_OPEN in content:
        content = content.split(TOOL_CALL_OPEN, 1)[0]
    markers = end_of_turn_markers(tokenizer) if tokenizer is not None else list(_END_OF_TURN)
    for m in markers:
        content = content.replace(m, "")
    message: dict[str, Any] = {"role": "assistant", "content": content.strip()}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                                 for c in calls]
    return message


def _render(tokenizer: Any, messages: list[dict[str, Any]], schemas, *, generation_prompt: bool, **kwargs) -> str:
    # (tokenizer: whatever renders the template: the tokenizer, or a VLM's processor when tool results hold images)
    """The chat template's text, memoised: every tool round renders the history three times (about 0.4 ms each
    for a 500-token prompt with a tool schema, under the GIL), and the samples of a prompt share that history
    (often the calls and results too). The key is the JSON of everything the template reads."""
    key: tuple[Any, str] | None
    try:  # the template is compared as itself (its hash is cached), not JSON-encoded into every key
        key = (getattr(tokenizer, "chat_template", None), _messages_key(messages) + "\x1f"
               + _KEY_ENCODER.encode([schemas, generation_prompt, kwargs]))
    except (TypeError, ValueError):  # not JSON-able: render it every time
        key = None
    cache = _RENDERS.get(tokenizer) if key is not None else None
    if cache is not None and key in cache:
        return cache[key]
    text = tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)
    if key is not None:
        with contextlib.suppress(TypeError):  # a tokenizer that takes no weak reference: no cache
            cache = _RENDERS.setdefault(tokenizer, {})
            if len(cache) >= _MAX_RENDERS:
                cache.clear()
            cache[key] = text
    return text


class _Encoded(list):
    """Messages that carry each one's JSON: `_suffix` renders three prefixes of one conversation per tool round,
    and each message is encoded once for their three keys instead of three times."""

    def __init__(self, messages: list[dict[str, Any]], parts: list[str]) -> None:
        super().__init__(messages)
        self.parts = parts


def _message_json(message: dict[str, Any]) -> str:
    return _KEY_ENCODER.encode(message)


# json.dumps(sort_keys=True, default=repr) builds an encoder per call: a third of a small message's encoding
_KEY_ENCODER = json.JSONEncoder(sort_keys=True, default=repr)


def _messages_key(messages: list[dict[str, Any]]) -> str:
    """The messages' part of a render's key: each message's JSON, joined by a character JSON always escapes."""
    parts = getattr(messages, "parts", None)
    return "\x1e".join(parts if parts is not None else map(_message_json, messages))


class MessageLog(list):
    """A conversation's messages that keeps each one's JSON once it is encoded (TurnLoop's conversations): a tool
    round then encodes only its new messages for the render cache's keys, not the whole conversation again.
    Grown by append / extend only, and a message is not changed once added (the kept JSON would go stale)."""

    def __init__(self, messages: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(messages)
        self._parts: list[str] = []

    def encoded(self) -> list[str]:
        """Each message's JSON (raises TypeError / ValueError for one that is not JSON)."""
        while len(self._parts) < len(self):
            self._parts.append(_message_json(self[len(self._parts)]))
        return self._parts


def _encoded_prefixes(messages: list[dict[str, Any]], *ends: int,
                      known: list[str] | None = None) -> list[list[dict[str, Any]]]:
    """messages[:end] for each end, as `_Encoded` lists sharing one encoding (plain lists if one is not JSON);
    `known`: the JSON of messages' first len(known) messages, already encoded."""
    try:
        known = known or []
        parts = known + [_message_json(m) for m in messages[len(known):]]
    except (TypeError, ValueError):
        return [messages[:end] for end in ends]
    return [_Encoded(messages[:end], parts[:end]) for end in ends]


# tokenizer -> {(template, JSON of a render's other inputs): its text}; cleared at _MAX_RENDERS entries
_RENDERS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, str], str]] = weakref.WeakKeyDictionary()
_MAX_RENDERS = 4096
# tokenizer -> {continuation text: its ids}: the samples of a prompt often get the same tool results
_ENCODED: weakref.WeakKeyDictionary[Any, dict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()


def end_of_turn_markers(tokenizer: Any, vocab: dict[str, int] | None = None) -> list[str]:
    """Strings that end an assistant turn for this tokenizer: its EOS token and the common chat markers it has.

    Computed once per tokenizer: `get_vocab()` builds a dict of the whole vocabulary (about 60 ms for
    SmolLM2's 49k tokens), and every tool round of every rollout asks (256 rounds a step took 15 s of host
    time, under the GIL, before this cache). vocab: the tokenizer's `get_vocab()`, when the caller has it."""
    try:
        return list(_MARKERS[tokenizer])
    except (KeyError, TypeError):  # TypeError: an object that takes no weak reference (a test double)
        pass
    markers = []
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos:
        markers.append(eos)
    if vocab is None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    markers += [m for m in _END_OF_TURN if m in vocab and m not in markers]
    with contextlib.suppress(TypeError):
        _MARKERS[tokenizer] = tuple(markers)
    return markers


# tokenizer -> its end-of-turn markers; weak keys, so a tokenizer is never kept alive by the cache
_MARKERS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()
_MARKER_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def end_of_turn_ids(tokenizer: Any) -> frozenset[int]:
    """The token ids of `end_of_turn_markers` that are single tokens of the vocabulary; computed once per
    tokenizer (a TurnLoop is often built per generate call, and `get_vocab()` takes ~20 ms)."""
    try:
        return _MARKER_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids = frozenset(vocab[m] for m in end_of_turn_markers(tokenizer, vocab) if m in vocab)
    with contextlib.suppress(TypeError):
        _MARKER_IDS[tokenizer] = ids
    return ids


def continuation_text(tokenizer: Any, conversation_so_far: Sequence[dict[str, Any]],
                      new_messages: Sequence[dict[str, Any]],
                      tools: Sequence[Tool | dict[str, Any]] | None = None, *, close_turn: bool = False,
                      renderer: Any = None, **template_kwargs: Any) -> str:
    """The text `continuation_ids` tokenises; see the module docstring. renderer: what applies the chat template
    (default the tokenizer; a VLM's processor for tool messages with images)."""
    if not conversation_so_far or conversation_so_far[-1].get("role") != "assistant":
        raise ValueError("continuation: conversation_so_far must end with the assistant message that made the calls")
    schemas = tool_schemas(tools)
    markers = end_of_turn_markers(tokenizer)
    conv, new = list(conversation_so_far), list(new_messages)
    render = tokenizer if renderer is None else renderer
    try:
        known = conversation_so_far.encoded() if isinstance(conversation_so_far, MessageLog) else None
    except (TypeError, ValueError):
        known = None
    text = _suffix(render, conv, new, schemas, markers, close_turn, template_kwargs, known)
    if text is None:  # the template re-renders history: render the new messages after a stand-in conversation
        stand_in = [{"role": "user", "content": "."}, conv[-1]]
        text = _suffix(render, stand_in, new, schemas, markers, close_turn, template_kwargs)
    if text is None:
        raise ConfigError(
            "the chat template renders a conversation differently once tool messages follow it, so the tool "
            "results cannot be appended to the model's sequence; use model.chat_template=chatml_tools")
    return text


def _suffix(tokenizer, conv, new, schemas, markers, close_turn, kwargs, known=None) -> str | None:
    everything, before, history = _encoded_prefixes(conv + new, len(conv) + len(new), len(conv) - 1, len(conv),
                                                    known=known)
    full = _render(tokenizer, everything, schemas, generation_prompt=True, **kwargs)
    # where the assistant's last message starts: after the conversation before it (no generation prompt: some
    # templates' prompt differs from how they render the assistant's header in history, e.g. Qwen3 with
    # enable_thinking=False adds an empty think block to the prompt only)
    head = _render(tokenizer, before, schemas, generation_prompt=False, **kwargs) if len(conv) > 1 else ""
    start = len(head) if full.startswith(head) else None
    base = _render(tokenizer, history, schemas, generation_prompt=False, **kwargs)
    if full.startswith(base[:_end_of_turn(base, start or 0, markers, close_turn)]):
        cut = _end_of_turn(base, start or 0, markers, close_turn)  # the plain case: `base` is a prefix of `full`
    elif start is not None:
        # the last assistant message renders differently once messages follow it (Qwen3 drops its empty
        # <think></think> then), but the history before it does not: cut `full` at that message's end of turn
        cut = _end_of_turn(full, start, markers, close_turn, first=True)
    else:
        return None
    return full[cut:]


def _end_of_turn(text: str, start: int, markers: Sequence[str], close_turn: bool, *, first: bool = False) -> int:
    """Index just after (close_turn: at) the last end-of-turn marker in text[start:] (first=True: the first one)."""
    found = [(text.find(m, start) if first else text.rfind(m, start), m) for m in markers]
    found = [(i, m) for i, m in found if i >= 0]
    if not found:
        return len(text)
    i, m = min(found) if first else max(found)
    return i if close_turn else i + len(m)


def continuation_ids(tokenizer: Any, conversation_so_far: Sequence[dict[str, Any]],
                     new_messages: Sequence[dict[str, Any]],
                     tools: Sequence[Tool | dict[str, Any]] | None = None, *, close_turn: bool = False,
                     **template_kwargs: Any) -> list[int]:
    """Token ids to append after the model's last completion so that generation continues on the same sequence.

    Args:
        tokenizer: the policy's tokenizer (with a chat template that renders tools).
        conversation_so_far: the messages up to and including the assistant message that made the tool calls
            (see `assistant_message`).
        new_messages: what to append, usually `tool_result_messages(results)`.
        tools: the tools (or their schemas) the prompt was rendered with.
        close_turn: True when the completion ended without its end-of-turn token (stopped by a stop string):
            the ids then start with that token.
        template_kwargs: extra chat template variables (e.g. `enable_thinking=False`).
    """
    text = continuation_text(tokenizer, conversation_so_far, new_messages, tools, close_turn=close_turn,
                             **template_kwargs)
    return _encode(tokenizer, text)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer(text, add_special_tokens=False)["input_ids"]`, memoised per tokenizer (the tool results of a
    prompt's samples, and the turn-closing text around them, repeat; a call costs ~40 us under the GIL)."""
    try:
        cache = _ENCODED.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that takes no weak reference: no cache
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = cache.get(text)
    if ids is None:
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(cache) >= _MAX_RENDERS:
            cache.clear()
        cache[text] = ids
    return list(ids)

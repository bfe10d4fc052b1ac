"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on the served engine (no streaming).

Requests are turned into token ids (the model's tokenizer; chat messages through its chat template with the
generation prompt) and `SamplingParams`; responses have OpenAI's JSON shapes (`text_completion`,
`chat.completion`, `usage`), so any OpenAI client can try the policy between training steps. The policy
version that served a request is in `system_fingerprint` ("cohort-v<version>").
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from cohort.serving import limits as L
from cohort.serving.limits import Limits, RequestError
from cohort.types import Completion, SamplingParams

__all__ = ["RequestError", "chat_request", "chat_response", "completion_request", "completion_response",
           "models_response"]

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "n", "seed", "stop", "top_k", "min_p",
                  "repetition_penalty", "ignore_eos", "stop_token_ids", "logprobs"}
_IGNORED = {"model", "user", "stream", "frequency_penalty", "presence_penalty", "echo", "best_of",
            "max_completion_tokens", "stream_options", "suffix", "logit_bias", "top_logprobs"}
# OpenAI's names that are SamplingParams fields as they are
_SAME = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "seed")


def _check_unsupported(body: dict) -> None:
    if body.get("stream"):
        raise RequestError("stream=true is not supported by cohort serve; send stream=false", param="stream")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key):
            raise RequestError(f"{key}={L.shown(body[key])} is not supported; use repetition_penalty", param=key)
    unknown = sorted(set(body) - _SAMPLING_KEYS - _IGNORED - {"prompt", "messages"})
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}", param=unknown[0])


def _params(body: dict, default_max_tokens: int, prompts: list[list[int]], limits: Limits,
            logprobs: str) -> SamplingParams:
    """SamplingParams from OpenAI's fields, each range-checked (limits.py); null means the default. Without
    max_tokens a request gets `default_max_tokens`, or the room its longest prompt leaves in the context."""
    _check_unsupported(body)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    values: dict[str, Any] = {key: body.get(key) for key in _SAME}
    values["stop_strings"] = stop
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None and limits.context is not None:
        max_tokens = max(1, min(default_max_tokens, limits.context - max(map(len, prompts), default=0)))
    values["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    params = L.sampling_params(values, limits, where="", names={"stop_strings": "stop"})
    given = body.get("logprobs")
    if given is not None and logprobs == "bool":  # chat: a boolean
        L.flag(given, "logprobs")
    elif given is not None and not isinstance(given, bool):  # completions: how many, 0..20 (or a boolean)
        L.integer(given, "logprobs", 0, 20, "send null, true/false or an integer 0..20")
    L.check_room(prompts, [params] * len(prompts), limits, field="prompt")
    return params


def check_model(body: dict, served: str) -> None:
    name = body.get("model")
    if name not in (None, "", served):
        raise RequestError(f"The model `{L.shown(name)}` does not exist; this server serves {served!r}", status=404,
                           param="model")


def _prompt_ids(prompt: Any, tokenizer, limits: Limits) -> list[list[int]]:
    """`prompt` (a string, a list of strings, token ids, or a list of token-id lists) as token-id lists."""
    if prompt is None or prompt == "" or prompt == []:
        prompt = None
    elif isinstance(prompt, str) or (isinstance(prompt, list)
                                     and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompt = [prompt]  # one prompt, text or token ids
    if not isinstance(prompt, list):
        raise RequestError("prompt is required: a string, a list of strings, token ids or a list of token-id lists",
                           param="prompt")
    if len(prompt) > limits.max_prompts:
        raise RequestError(f"prompt has {len(prompt)} prompts; send at most {limits.max_prompts} per request",
                           param="prompt")
    ids = [tokenizer(L.text(p, f"prompt[{i}]", limits.max_text_chars))["input_ids"] if isinstance(p, str) else p
           for i, p in enumerate(prompt)]
    return L.prompts(ids, limits, field="prompt")


def completion_request(body: dict, tokenizer, served: str,
                       limits: Limits | None = None) -> tuple[list[list[int]], SamplingParams]:
    """Prompts (a string, a list of strings, token ids, or a list of token-id lists) -> ids, params."""
    limits = limits or Limits()
    check_model(body, served)
    ids = _prompt_ids(body.get("prompt"), tokenizer, limits)
    return ids, _params(body, 16, ids, limits, logprobs="int")


def _check_messages(messages: Any, limits: Limits) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    if len(messages) > limits.max_messages:
        raise RequestError(f"messages has {len(messages)} entries; send at most {limits.max_messages}",
                           param="messages")
    for i, m in enumerate(messages):
        L.text(m.get("role"), f"messages[{i}].role", 64, empty=False)
        content = m.get("content")
        if content is not None and not isinstance(content, list):
            L.text(content, f"messages[{i}].content", limits.max_text_chars)
    return messages


def chat_request(body: dict, tokenizer, served: str,
                 limits: Limits | None = None) -> tuple[list[list[int]], SamplingParams]:
    limits = limits or Limits()
    check_model(body, served)
    messages = _check_messages(body.get("messages"), limits)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("the served model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own checks (jinja raises its own errors): the messages' fault
        raise RequestError(f"messages could not be rendered with the chat template: {type(exc).__name__}: "
                           f"{str(exc)[:200]}", param="messages") from None
    ids = L.prompts([tokenizer(text, add_special_tokens=False)["input_ids"]], limits, field="messages")
    return ids, _params(body, 256, ids, limits, logprobs="bool")


def _usage(prompts: list[list[int]], groups: list[list[Completion]]) -> dict:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for g in groups for c in g)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def completion_response(body: dict, tokenizer, served: str, prompts, groups, version: int) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for c in (c for g in groups for c in g):
        choice: dict[str, Any] = {"index": len(choices), "text": _text(tokenizer, c.token_ids), "logprobs": None,
                                  "finish_reason": c.finish_reason}
        if body.get("logprobs") is not None:
            tokens = [tokenizer.decode([t]) for t in c.token_ids]
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(c.logprobs), "top_logprobs": None,
                                  "text_offset": offsets}
        choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": served, "system_fingerprint": f"cohort-v{version}", "choices": choices,
            "usage": _usage(prompts, groups)}


def chat_response(body: dict, tokenizer, served: str, prompts, groups, version: int) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for c in groups[0]:
        logprobs = None
        if body.get("logprobs"):
            logprobs = {"content": [{"token": tokenizer.decode([t]), "logprob": lp,
                                     "bytes": list(tokenizer.decode([t]).encode()), "top_logprobs": []}
                                    for t, lp in zip(c.token_ids, c.logprobs)]}
        choices.append({"index": len(choices), "message": {"role": "assistant", "content": _text(tokenizer, c.token_ids)},
                        "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": served, "system_fingerprint": f"cohort-v{version}", "choices": choices,
            "usage": _usage(prompts, groups)}


def models_response(served: str) -> dict:
    return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "cohort"}]}

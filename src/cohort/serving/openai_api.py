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

from cohort.errors import CohortError
from cohort.types import Completion, SamplingParams


class RequestError(CohortError):
    """A malformed request: answered with HTTP 400 (404 for an unknown model) and OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "n", "seed", "stop", "top_k", "min_p",
                  "repetition_penalty", "ignore_eos", "stop_token_ids", "logprobs"}
_IGNORED = {"model", "user", "stream", "frequency_penalty", "presence_penalty", "echo", "best_of",
            "max_completion_tokens", "stream_options", "suffix", "logit_bias", "top_logprobs"}


def _params(body: dict, default_max_tokens: int) -> SamplingParams:
    if body.get("stream"):
        raise RequestError("stream=true is not supported by cohort serve; send stream=false", param="stream")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key):
            raise RequestError(f"{key}={body[key]!r} is not supported; use repetition_penalty", param=key)
    unknown = sorted(set(body) - _SAMPLING_KEYS - _IGNORED - {"prompt", "messages"})
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}", param=unknown[0])
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else list(stop)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens")) or default_max_tokens
    try:
        params = SamplingParams(
            n=int(body.get("n", 1)), max_tokens=int(max_tokens), temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0) or 0),
            min_p=float(body.get("min_p", 0.0) or 0.0),
            repetition_penalty=float(body.get("repetition_penalty", 1.0)),
            stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()), stop_strings=tuple(stop),
            ignore_eos=bool(body.get("ignore_eos", False)),
            seed=None if body.get("seed") is None else int(body["seed"]))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"bad sampling field: {exc}") from None
    if params.n < 1 or params.max_tokens < 1:
        raise RequestError(f"n={params.n} and max_tokens={params.max_tokens} must be >= 1")
    return params


def check_model(body: dict, served: str) -> None:
    name = body.get("model")
    if name not in (None, "", served):
        raise RequestError(f"The model `{name}` does not exist; this server serves {served!r}", status=404,
                           param="model")


def completion_request(body: dict, tokenizer, served: str) -> tuple[list[list[int]], SamplingParams]:
    """Prompts (a string, a list of strings, token ids, or a list of token-id lists) -> ids, params."""
    check_model(body, served)
    prompt = body.get("prompt")
    if prompt is None or prompt == "" or prompt == []:
        raise RequestError("prompt is required", param="prompt")
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):  # one prompt, text or token ids
        prompt = [prompt]
    ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else [int(t) for t in p] for p in prompt]
    return ids, _params(body, default_max_tokens=16)


def chat_request(body: dict, tokenizer, served: str) -> tuple[list[list[int]], SamplingParams]:
    check_model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("the served model's tokenizer has no chat template; use /v1/completions", param="messages")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return [tokenizer(text, add_special_tokens=False)["input_ids"]], _params(body, default_max_tokens=256)


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

"""What `cohort serve` accepts: every field of a request checked against its range before any work starts.

A field out of range is refused with a 400 that names the field, the value and what to send instead
(`RequestError`): NaN, infinities and negative numbers never reach the engine (a NaN temperature used to sample
greedily, a NaN `wait_s` spun a server thread forever), token ids lie inside the vocabulary, prompt + max_tokens
inside the server's context, counts and string sizes are bounded. The body itself is bounded one layer up
(httpd.py: Content-Length, --max-body-mb). docs/serving.md, "Authentication and limits", lists every limit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cohort.errors import CohortError
from cohort.types import SamplingParams

MAX_SEED = (1 << 62) - 1  # the engines draw with seed + i * n + j, below 2**63
MAX_VERSION = (1 << 62) - 1
_NO_CONTEXT_MAX_TOKENS = 1 << 20  # max_tokens when the engine names no context (Hugging Face generate)


class RequestError(CohortError):
    """A request the server refuses: answered with `status` (400 unless said) and OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True)
class Limits:
    """The server's bounds on one request."""

    vocab_size: int | None = None  # token ids lie in [0, vocab_size): the embedding's rows
    context: int | None = None  # prompt + max_tokens (the engine's max_model_len)
    max_body_bytes: int = 16 << 20  # --max-body-mb
    max_prompts: int = 65536  # prompts of one request
    max_sequences: int = 1 << 17  # completions of one request: the sum of n over its prompts
    max_n: int = 1024
    max_stop_strings: int = 64
    max_stop_chars: int = 1024  # one stop string
    max_text_chars: int = 1 << 18  # one text prompt or chat message
    max_messages: int = 1024
    max_session_chars: int = 256
    max_wait_s: float = 3600.0  # a longer wait_s waits this long
    max_poll_s: float = 60.0  # a longer /sessions/wait timeout_s waits this long


def shown(value: Any) -> str:
    """A value as an error message quotes it: short, whatever its size."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} characters)"


def real(value: Any, field: str, fix: str, ok: Callable[[float], bool]) -> float:
    """A JSON number (not a boolean), finite and accepted by `ok`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{field}={shown(value)} is not a number; {fix}", param=field)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float's range
        number = math.inf
    if not math.isfinite(number) or not ok(number):
        raise RequestError(f"{field}={shown(value)} is out of range; {fix}", param=field)
    return number


def integer(value: Any, field: str, low: int, high: int, fix: str) -> int:
    """A JSON integer (2.0 counts; booleans do not) in [low, high]."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{field}={shown(value)} is not an integer; {fix}", param=field)
    if not low <= value <= high:
        raise RequestError(f"{field}={shown(value)} is out of range; {fix}", param=field)
    return value


def flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{field}={shown(value)} is not a boolean; send true or false", param=field)
    return value


def text(value: Any, field: str, max_chars: int, *, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{field}={shown(value)} is not a string", param=field)
    if len(value) > max_chars or (not value and not empty):
        raise RequestError(f"{field} has {len(value)} characters; send 1 to {max_chars}", param=field)
    return value


def token_ids(value: Any, field: str, vocab: int | None, max_len: int, *, empty: bool = False) -> list[int]:
    """A list of token ids, each an integer in [0, vocab)."""
    if not isinstance(value, list):
        raise RequestError(f"{field}={shown(value)} is not a list of token ids", param=field)
    if not value and not empty:
        raise RequestError(f"{field} is empty; a prompt needs at least one token (e.g. BOS)", param=field)
    if len(value) > max_len:
        raise RequestError(f"{field} has {len(value)} tokens, more than the {max_len} the server takes "
                           "(its context, --max-model-len, holds prompt + completion)", param=field)
    high = vocab - 1 if vocab else MAX_VERSION
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= high:
            raise RequestError(f"{field}[{i}]={shown(t)} is not a token id of the served model: send integers in "
                               f"[0, {vocab if vocab else 2 ** 62})", param=field)
    return value


# ---- sampling parameters -------------------------------------------------------------------------------

_REALS: dict[str, tuple[str, Callable[[float], bool]]] = {
    "temperature": ("send a finite number >= 0 (0: greedy), e.g. 1.0", lambda x: x >= 0),
    "top_p": ("send a number in (0, 1], e.g. 1.0 (no nucleus filter)", lambda x: 0 < x <= 1),
    "min_p": ("send a number in [0, 1], e.g. 0 (off)", lambda x: 0 <= x <= 1),
    "repetition_penalty": ("send a finite number > 0, e.g. 1.0 (off)", lambda x: x > 0),
}


def _max_tokens(value: Any, field: str, limits: Limits) -> int:
    high = limits.context or _NO_CONTEXT_MAX_TOKENS
    return integer(value, field, 1, high, f"send 1 to {high} (the server's context, --max-model-len, holds "
                                          "prompt + completion)")


def _real_field(value: Any, field: str, limits: Limits, rule: tuple[str, Callable[[float], bool]]) -> float:
    return real(value, field, *rule)


def _stop_strings(value: Any, field: str, limits: Limits) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > limits.max_stop_strings:
        raise RequestError(f"{field}={shown(value)}: send a list of at most {limits.max_stop_strings} strings",
                           param=field)
    return tuple(text(s, f"{field}[{i}]", limits.max_stop_chars, empty=False) for i, s in enumerate(value))


_FIELDS: dict[str, Callable[[Any, str, Limits], Any]] = {
    "n": lambda v, f, lim: integer(v, f, 1, lim.max_n, f"send 1 to {lim.max_n} completions per prompt"),
    "max_tokens": _max_tokens,
    "top_k": lambda v, f, lim: integer(v, f, 0, 1 << 31, "send an integer >= 0 (0: off)"),
    "seed": lambda v, f, lim: integer(v, f, 0, MAX_SEED, f"send an integer in [0, {MAX_SEED}] or null"),
    "ignore_eos": lambda v, f, lim: flag(v, f),
    "stop_token_ids": lambda v, f, lim: tuple(token_ids(v, f, lim.vocab_size, max(1024, lim.vocab_size or 0),
                                                        empty=True)),
    "stop_strings": _stop_strings,
    **{name: functools.partial(_real_field, rule=rule) for name, rule in _REALS.items()},
}
assert set(_FIELDS) == {f.name for f in dataclasses.fields(SamplingParams)}, "a SamplingParams field is unchecked"


def sampling_params(data: Any, limits: Limits, where: str = "params",
                    names: Mapping[str, str] | None = None) -> SamplingParams:
    """SamplingParams from a JSON object of its fields, each checked; null means the default. Errors name a
    field as `where.field` (`names` maps a field to the name the client used, e.g. stop_strings -> stop)."""
    if not isinstance(data, Mapping):
        raise RequestError(f"{where}={shown(data)} is not an object of sampling fields", param=where)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise RequestError(f"unknown sampling field(s) {unknown}; known: {sorted(_FIELDS)}", param=unknown[0])
    values = {}
    for key, value in data.items():
        if value is not None:
            field = (names or {}).get(key, key)
            values[key] = _FIELDS[key](value, f"{where}.{field}" if where else field, limits)
    return SamplingParams(**values)


# ---- whole requests ------------------------------------------------------------------------------------


def prompts(value: Any, limits: Limits, field: str = "prompts") -> list[list[int]]:
    """A list of token-id lists (at most `max_prompts`, each within the context)."""
    if not isinstance(value, list):
        raise RequestError(f"{field} must be a list of token-id lists", param=field)
    if len(value) > limits.max_prompts:
        raise RequestError(f"{field} has {len(value)} prompts; send at most {limits.max_prompts} per request",
                           param=field)
    longest = limits.context - 1 if limits.context else _NO_CONTEXT_MAX_TOKENS
    return [token_ids(p, f"{field}[{i}]", limits.vocab_size, longest) for i, p in enumerate(value)]


def check_room(ids: list[list[int]], params: list[SamplingParams], limits: Limits, field: str = "prompts") -> None:
    """The request as a whole: at most `max_sequences` completions, each prompt + max_tokens within the context."""
    total = sum(p.n for p in params)
    if total > limits.max_sequences:
        raise RequestError(f"the request asks for {total} completions (n summed over its prompts); send at most "
                           f"{limits.max_sequences} per request", param="n")
    if limits.context is None:
        return
    for i, (prompt, p) in enumerate(zip(ids, params, strict=True)):
        if len(prompt) + p.max_tokens > limits.context:
            raise RequestError(f"{field}[{i}] has {len(prompt)} tokens + max_tokens={p.max_tokens} = "
                               f"{len(prompt) + p.max_tokens}, more than the server's context of {limits.context} "
                               "(--max-model-len); lower max_tokens or shorten the prompt", param="max_tokens")


def wait_seconds(value: Any, limits: Limits, field: str = "wait_s") -> float:
    """A wait in seconds: finite, >= 0, cut to `max_wait_s`."""
    if value is None:
        return 0.0
    seconds = real(value, field, f"send a finite number of seconds >= 0 (at most {limits.max_wait_s:g} is waited)",
                   lambda x: x >= 0)
    return min(seconds, limits.max_wait_s)


def version(value: Any, field: str = "version") -> int:
    return integer(value, field, 0, MAX_VERSION, "send a policy version, an integer >= 0")


def min_version(value: Any) -> int | None:
    """The oldest version a request accepts (the pipeline of train.max_staleness may ask for one below 0: any)."""
    if value is None:
        return None
    return integer(value, "min_version", -MAX_VERSION, MAX_VERSION, "send a policy version, an integer, or null")


def gpu_id(value: Any) -> str | None:
    """A GPU's UUID as torch prints it (the trainer's, so the server can tell a GPU it shares), or null."""
    return None if value is None else text(value, "gpu", 64)


def session(value: Any, limits: Limits) -> str | None:
    return None if value is None else text(value, "session", limits.max_session_chars)


_GENERATE_KEYS = {"prompts", "params", "min_version", "session", "wait_s"}


def generate_request(body: dict, limits: Limits) -> tuple[list[list[int]], SamplingParams | list[SamplingParams],
                                                          dict[str, Any]]:
    """POST /generate's body: prompts, their SamplingParams (one, or one per prompt) and the keywords of
    EngineServer.generate (min_version, wait_s, session), every field checked."""
    unknown = sorted(set(body) - _GENERATE_KEYS)
    if unknown:
        raise RequestError(f"unknown field(s) {unknown}; /generate takes {sorted(_GENERATE_KEYS)}", param=unknown[0])
    ids = prompts(body.get("prompts"), limits)
    raw = body.get("params") or {}
    params: SamplingParams | list[SamplingParams]
    if isinstance(raw, list):  # one per prompt (a multi-turn round: each conversation its own room and seed)
        if len(raw) != len(ids):
            raise RequestError(f"params: got {len(raw)} for {len(ids)} prompts; give one object, or one per prompt",
                               param="params")
        params = [sampling_params(item or {}, limits, f"params[{i}]") for i, item in enumerate(raw)]
        check_room(ids, params, limits)
    else:
        params = sampling_params(raw, limits)
        check_room(ids, [params] * len(ids), limits)
    keywords = {"min_version": min_version(body.get("min_version")),
                "wait_s": wait_seconds(body.get("wait_s"), limits), "session": session(body.get("session"), limits)}
    return ids, params, keywords

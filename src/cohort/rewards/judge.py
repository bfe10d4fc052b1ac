"""An LLM judge as a reward function: `JudgeReward`, the `judge` built-in.

Each completion is put into a prompt template and sent to an OpenAI-compatible ``/v1/chat/completions``
endpoint (``cohort serve`` serving a second model, vLLM, a hosted API); the score is read off the answer with a
regular expression and divided by ``max_score``, so the reward is in [0, 1]. Requests run concurrently on a
bounded thread pool, each with a time limit, and a request that times out, cannot connect or gets HTTP 429 or
5xx is retried with exponential backoff. Only the standard library is used (``urllib``).

    reward:
      funcs:
        - judge: {base_url: "http://127.0.0.1:8000", model: judge-model, max_score: 10}

A malformed answer (no score, or one outside ``[0, max_score]``), an HTTP error or a request that fails every
try raises `JudgeError` naming the sample and the answer text (truncated); the reward runner turns it into
its usual error, or into None for that sample with ``reward.on_error: skip``. The outcomes of the last batch
are kept, so the runner's one-sample-at-a-time re-run (how it finds the failing samples) sends no new requests.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from cohort.rewards.protocol import RESERVED_ARGS, RewardError, completion_text

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer:\n{answer}\n\n"
    "Answer to grade:\n{completion}\n\n"
    "How correct is the answer to grade, compared with the reference? Explain briefly, then end with a line "
    "'Score: N', N an integer from 0 (wrong) to 10 (fully correct)."
)
# "Score: 7", "score = 7.5", "**Score:** 8" (the last one in the answer counts)
DEFAULT_SCORE_REGEX = r"(?i)score\s*\**\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
_BARE_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*")
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class JudgeError(RewardError):
    """A judge request failed or its answer held no valid score; the message names the sample and the answer."""


def _clip(text: str, limit: int = 200) -> str:
    text = text.replace("\n", "\\n")
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def chat_url(base_url: str) -> str:
    """``base_url`` as the chat-completions URL: ``http://h:p``, ``http://h:p/v1`` or the full route all work."""
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


def prompt_text(prompt: Any) -> str:
    """A prompt's text: the last user message's content for a conversational prompt."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str((users or prompt)[-1].get("content", "")) if prompt else ""
    return str(prompt)


class JudgeReward:
    """Score completions with a judge model behind an OpenAI-compatible chat endpoint (see the module).

    base_url, model: the server and the model name sent in each request.
    template: the user message; ``{prompt}`` (last user message), ``{completion}``, ``{answer}`` (the row's
        ``answer`` column, else ``solution``) and any other dataset column by name; write ``{{`` for a brace.
    system_prompt: an optional system message before it.
    score_regex: the score is the first group (or the whole match) of the regex's last match in the answer; an
        answer that is only a number is accepted too. max_score: the score's top (10 for "0 to 10", 1 for a
        probability); the reward is score / max_score, and a score outside [0, max_score] is malformed.
    max_workers: concurrent requests. timeout_s: each request's time limit. max_retries: tries after the first
        for timeouts, connection errors, HTTP 408/429/5xx; backoff_s: the wait before retry i is
        ``backoff_s * 2**i``.
    api_key_env: the environment variable holding the API key, sent as ``Authorization: Bearer``; unset or
        empty sends no header. temperature, max_tokens, extra_body: the request's sampling fields (extra_body
        is merged into the JSON body). name: the metric name (``rewards/<name>/mean``).
    """

    def __init__(self, base_url: str, model: str, template: str = DEFAULT_TEMPLATE, *,
                 system_prompt: str | None = None, score_regex: str = DEFAULT_SCORE_REGEX, max_score: float = 10.0,
                 max_workers: int = 8, timeout_s: float = 60.0, max_retries: int = 2, backoff_s: float = 1.0,
                 api_key_env: str = "COHORT_JUDGE_API_KEY", temperature: float = 0.0, max_tokens: int = 512,
                 extra_body: dict[str, Any] | None = None, name: str = "judge"):
        _check_settings(base_url, model, max_score, max_workers, timeout_s, max_retries, backoff_s)
        try:
            self.score_pattern = re.compile(score_regex)
        except re.error as e:
            raise ValueError(f"judge score_regex {score_regex!r} is not a valid regular expression: {e}") from e
        self.fields = {f for _, f, _, _ in string.Formatter().parse(template) if f}
        self.url, self.model, self.template, self.system_prompt = chat_url(base_url), model, template, system_prompt
        self.max_score, self.max_workers, self.timeout_s = float(max_score), int(max_workers), float(timeout_s)
        self.max_retries, self.backoff_s, self.api_key_env = int(max_retries), float(backoff_s), api_key_env
        self.body = {"temperature": temperature, "max_tokens": max_tokens, **(extra_body or {})}
        self.name = self.__name__ = name
        self._memo: dict[str, float | Exception] = {}  # the last batch's outcomes, by request text
        self._lock = threading.Lock()

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        columns = {k: v for k, v in columns.items() if k not in RESERVED_ARGS}
        messages = [self.render(i, prompts, completions, columns) for i in range(len(completions))]
        with self._lock:
            memo = dict(self._memo)
        if len(messages) == 1 and messages[0] in memo:  # the runner re-running one sample of the last batch
            outcomes = [memo[messages[0]]]
        else:
            workers = min(self.max_workers, max(1, len(messages)))
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                outcomes = list(pool.map(self._outcome, messages))
            if len(messages) > 1:
                with self._lock:
                    self._memo = dict(zip(messages, outcomes))
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, Exception):
                raise JudgeError(f"judge {self.name!r}, sample {i} of {len(outcomes)}: {outcome}") from outcome
        return [float(o) for o in outcomes]  # type: ignore[arg-type]

    def render(self, i: int, prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Any]) -> str:
        """The template filled with sample i's prompt, completion, answer and columns."""
        values = {k: v[i] for k, v in columns.items() if isinstance(v, list | tuple) and len(v) == len(completions)}
        gold = values.get("answer", values.get("solution"))
        values.update(prompt=prompt_text(prompts[i]), completion=completion_text(completions[i]))
        if gold is not None:
            values["answer"] = gold
        missing = sorted(self.fields - set(values))
        if missing:
            raise JudgeError(f"judge {self.name!r}: the template uses {missing}, which the rows do not have; "
                             f"available: {sorted(values)}. Add the column(s) or change the template.")
        return self.template.format_map({k: "" if v is None else v for k, v in values.items()})

    def score(self, answer: str) -> float:
        """The reward in [0, 1] read off a judge's answer; ValueError naming the answer when there is none."""
        found = self.score_pattern.findall(answer)
        if found:
            last = found[-1]
            text = last if isinstance(last, str) else next((g for g in last if g), "")
        elif (bare := _BARE_NUMBER.fullmatch(answer)) is not None:
            text = bare.group(1)
        else:
            raise ValueError(f"no score matching {self.score_pattern.pattern!r} in the judge's answer {_clip(answer)}")
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"the score {text!r} in the judge's answer {_clip(answer)} is not a number") from None
        if not (math.isfinite(value) and 0.0 <= value <= self.max_score):
            raise ValueError(f"the score {value:g} is outside [0, {self.max_score:g}] in the judge's answer "
                             f"{_clip(answer)}")
        return value / self.max_score

    # -- requests ------------------------------------------------------------------------------------
    def _outcome(self, message: str) -> float | Exception:
        try:
            return self.score(self._ask(message))
        except Exception as e:  # reported per sample by __call__
            return e

    def _ask(self, message: str) -> str:
        """The judge's answer to one user message, retried with backoff on transient failures."""
        msgs = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        data = json.dumps({"model": self.model, "messages": [*msgs, {"role": "user", "content": message}],
                           **self.body}).encode()
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get(self.api_key_env, ""):
            headers["Authorization"] = f"Bearer {key}"
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return _answer_text(response.read())
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")
                last = RuntimeError(f"HTTP {e.code} from {self.url}: {_clip(body)}")
                if e.code not in _RETRY_STATUS:
                    raise last from None
            except (TimeoutError, urllib.error.URLError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                last = RuntimeError(f"timed out after {self.timeout_s:g} s" if isinstance(reason, TimeoutError)
                                    else f"cannot reach {self.url}: {reason}")
        raise RuntimeError(f"the judge request failed {self.max_retries + 1} times, last: {last}")


def _answer_text(raw: bytes) -> str:
    """The first choice's message content of a chat-completions response; ValueError naming the body."""
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        body = _clip(raw.decode(errors="replace"))
        raise ValueError(f"the judge's response is not a chat completion: {body}") from None
    return "" if content is None else str(content)


def _check_settings(base_url: str, model: str, max_score: float, max_workers: int, timeout_s: float,
                    max_retries: int, backoff_s: float) -> None:
    checks = [
        (isinstance(base_url, str) and base_url.startswith(("http://", "https://")), "base_url", base_url,
         "an http(s) URL such as http://127.0.0.1:8000"),
        (isinstance(model, str) and model != "", "model", model, "the served model's name"),
        (max_score > 0, "max_score", max_score, "a positive number: 10 for a 0-10 scale, 1 for [0, 1]"),
        (max_workers >= 1, "max_workers", max_workers, "1 or more concurrent requests"),
        (timeout_s > 0, "timeout_s", timeout_s, "a positive number of seconds"),
        (max_retries >= 0, "max_retries", max_retries, "0 or more"),
        (backoff_s >= 0, "backoff_s", backoff_s, "0 or more seconds"),
    ]
    for ok, field, value, fix in checks:
        if not ok:
            raise ValueError(f"judge {field}={value!r}: use {fix}.")

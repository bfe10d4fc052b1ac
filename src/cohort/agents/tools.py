"""Tools: Python functions the model may call, their JSON schemas, and the runner that executes one turn's calls.

A tool is a plain function (or an `async def`, or a bound method of an environment) with type hints and a
Google-style docstring. Its schema comes from `transformers.utils.get_json_schema`, the helper that
`apply_chat_template(..., tools=[fn])` itself uses, so what the chat template shows the model is exactly what
`Tool.schema` holds.

`ToolRunner.run(calls)` executes the calls of one assistant turn concurrently: coroutine tools together on an
event loop (`asyncio.gather`), sync tools each on its own daemon thread, every call under `timeout_s`. Nothing a
tool does can crash the rollout: an exception, an unknown tool name, arguments that do not fit the signature,
a malformed call from the parser, or a timeout becomes a `ToolResult` whose `content` is an error message for
the model and whose `failed` is True (counted in `tools/failure_frequency`).

A timed-out sync tool cannot be stopped from Python (threads cannot be killed): its thread is a daemon, its
result is dropped, and it keeps running until it returns. Tools that may run away should enforce their own
limits, as `cohort.agents.builtins:python` does with a subprocess: `tool_time_left()`, called inside a tool, gives
the seconds until the runner stops waiting for it, so it can stop at the same time (the python tool kills its
process then).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from cohort.agents.workers import WORKERS, in_daemon_thread, run_sync, tool_deadline, tool_time_left
from cohort.data.sources import import_object
from cohort.errors import ConfigError

INVALID_TOOL_NAME = "__invalid__"  # the parser's name for a call it could not read (see parsing.py)
_run_sync = run_sync  # the old private name (bench/turns.py)
__all__ = ["Tool", "ToolCall", "ToolResult", "ToolRunner", "build_tools", "run_turns", "tool_metrics", "tool_schema",
           "tool_schemas", "tool_time_left"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What a call returned, as the text the model will read; `failed` marks errors of any kind.

    images: the images a tool returned as content blocks (TRL's `[{"type": "image", "image": ...}, {"type":
    "text", ...}]`), and parts: those blocks in order, each ("image", index into images) or ("text", str); a
    vision-language model reads them (`cohort.agents.messages.tool_result_messages`), `content` holds the text.
    seconds: how long the call itself ran (at least the timeout for one that timed out); None when it never ran
    (an unknown tool, bad arguments). Not part of equality: results compare by what the model reads."""

    name: str
    content: str
    failed: bool = False
    images: tuple = ()
    parts: tuple = ()
    seconds: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Tool:
    """A callable tool and the JSON schema the chat template renders for it."""

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool

    @classmethod
    def from_callable(cls, fn: Callable[..., Any], *, name: str | None = None) -> Tool:
        schema = tool_schema(fn, name=name)
        return cls(name=schema["function"]["name"], function=fn, schema=schema,
                   is_async=inspect.iscoroutinefunction(fn))


def tool_schema(fn: Callable[..., Any], *, name: str | None = None) -> dict[str, Any]:
    """`get_json_schema(fn)`, with a ConfigError naming the tool and the fix when the function cannot be described."""
    label = name or getattr(fn, "__qualname__", None) or repr(fn)
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException, ...
        raise ConfigError(
            f"tool {label!r}: cannot build its JSON schema ({exc}). A tool needs a type hint on every argument and a "
            "Google-style docstring with a one-line description and an 'Args:' section describing each argument, "
            "e.g.\n    def add(a: int, b: int) -> int:\n        \"\"\"Add two integers.\n\n        Args:\n"
            "            a: The first number.\n            b: The second number.\n        \"\"\""
        ) from exc
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return schema


def build_tools(funcs: Sequence[Callable[..., Any] | str | Tool] | None) -> list[Tool]:
    """Tools from functions, `Tool`s, or import paths `"pkg.module:function"`; names must be unique."""
    tools: list[Tool] = []
    for item in funcs or []:
        if isinstance(item, Tool):
            tools.append(item)
            continue
        fn = import_object(item) if isinstance(item, str) else item
        if not callable(fn):
            raise ConfigError(f"tool {item!r} is not callable; give a function or a 'pkg.module:function' path.")
        tools.append(Tool.from_callable(fn))
    seen: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in seen and seen[tool.name].function is not tool.function:
            raise ConfigError(f"two tools are named {tool.name!r}; tool names must be unique (rename one function).")
        seen[tool.name] = tool
    return list(seen.values())


def tool_schemas(tools: Sequence[Tool | dict[str, Any] | Callable[..., Any]] | None) -> list[dict[str, Any]]:
    """The list of JSON schemas `apply_chat_template(..., tools=...)` takes, from Tools, schemas or functions."""
    out = []
    for t in tools or []:
        if isinstance(t, Tool):
            out.append(t.schema)
        elif isinstance(t, dict):
            out.append(t)
        else:
            out.append(tool_schema(t))
    return out


_CASTS: dict[str, Callable[[str], Any]] = {
    "integer": int, "number": float, "boolean": lambda s: {"true": True, "false": False}[s.strip().lower()]}


def _coerce_arguments(tool: Tool, arguments: Any) -> Any:
    """Strings given for integer/number/boolean parameters, cast to that type where they parse ("7" -> 7), as
    transformers' parse_response does with `tools=`; anything else is left for the signature check."""
    if not isinstance(arguments, dict):
        return arguments
    props = tool.schema["function"].get("parameters", {}).get("properties", {})
    out = dict(arguments)
    for key, value in arguments.items():
        cast = _CASTS.get(str(props.get(key, {}).get("type")))
        if cast is not None and isinstance(value, str):
            with contextlib.suppress(ValueError, KeyError):
                out[key] = cast(value)
    return out


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    """`inspect.signature(fn)`, None for builtins without one (the call itself then decides)."""
    try:
        return inspect.signature(fn)
    except ValueError:
        return None


def _check_arguments(tool: Tool, arguments: Any, signature: inspect.Signature | None = None) -> str | None:
    """None when `arguments` fits the tool's signature (given, or read from the function), else an error message
    for the model."""
    if not isinstance(arguments, dict):
        return f"the arguments of {tool.name!r} must be a JSON object, got {type(arguments).__name__}"
    if signature is None:
        signature = _signature(tool.function)
    if signature is None:
        return None
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        props = tool.schema["function"].get("parameters", {}).get("properties", {})
        return f"bad arguments for {tool.name!r}: {exc}; it takes {sorted(props)}"
    return None


class ToolRunner:
    """Runs the tool calls of one turn concurrently, each under a timeout; never raises for a tool's fault."""

    def __init__(self, tools: Sequence[Tool | Callable[..., Any] | str], timeout_s: float = 10.0,
                 max_result_chars: int | None = None, serial: bool = False):
        """`serial=True` runs one turn's calls one after another, in order (still each under the timeout): for
        tools sharing mutable state, such as an environment's methods, whose results must not depend on timing."""
        self.tools = {t.name: t for t in build_tools(list(tools))}
        self.timeout_s = float(timeout_s)
        self.max_result_chars = max_result_chars
        self.serial = serial
        # each tool's signature, read on its first call (inspect.signature costs ~20 us a call otherwise)
        self._signatures: dict[str, inspect.Signature | None] = {}

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Results in the order of `calls`. Safe to call from inside a running event loop (uses a helper thread).

        Calls to sync tools only (the common case) skip the event loop: each goes to a reused daemon worker
        thread (`cohort.agents.workers.WORKERS`) and is waited for under the timeout. An event loop and a fresh
        thread per call cost about 1 ms a turn, under the GIL that the engine's loop needs."""
        if not calls:
            return []
        if any((t := self.tools.get(c.name)) is not None and t.is_async for c in calls):
            return run_sync(self.arun(calls))
        prepared = [self._prepare(c) for c in calls]
        if self.serial:
            results = []
            for c, p in zip(calls, prepared):
                deadline = time.monotonic() + self.timeout_s
                future = None if isinstance(p, ToolResult) else WORKERS.submit(p[0].function, p[1], deadline)
                results.append(self._settle(c, p, future, deadline))
            return results
        deadline = time.monotonic() + self.timeout_s  # all calls run at once, each under the timeout
        futures = [None if isinstance(p, ToolResult) else WORKERS.submit(p[0].function, p[1], deadline)
                   for p in prepared]
        return [self._settle(c, p, f, deadline) for c, p, f in zip(calls, prepared, futures)]

    def _settle(self, call: ToolCall, prepared, future, deadline: float) -> ToolResult:
        """The result of a call run on a worker (or the error `_prepare` found), waiting until `deadline`."""
        if isinstance(prepared, ToolResult):
            return prepared
        name = call.name
        try:
            value = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return ToolResult(name, f"Error: tool {name!r} timed out after {self.timeout_s:g} s.", failed=True,
                              seconds=self.timeout_s)
        except Exception as exc:
            return ToolResult(name, f"Error: tool {name!r} raised {type(exc).__name__}: {exc}", failed=True,
                              seconds=getattr(future, "seconds", None))
        return self._result(name, value, getattr(future, "seconds", None))

    async def arun(self, calls: Sequence[ToolCall], _gate: asyncio.Semaphore | None = None) -> list[ToolResult]:
        """The coroutine behind `run`, for callers that already have an event loop."""
        async def one(call: ToolCall) -> ToolResult:
            if _gate is None:
                return await self._one(call)
            async with _gate:
                return await self._one(call)

        if self.serial:
            return [await one(c) for c in calls]
        return list(await asyncio.gather(*(one(c) for c in calls)))

    async def _one(self, call: ToolCall) -> ToolResult:
        prepared = self._prepare(call)
        if isinstance(prepared, ToolResult):
            return prepared
        tool, arguments = prepared
        name = call.name
        deadline = time.monotonic() + self.timeout_s
        start = time.perf_counter()
        try:
            with tool_deadline(deadline):  # this task's own context: its async tool sees it, other calls do not
                if tool.is_async:
                    value = await asyncio.wait_for(tool.function(**arguments), self.timeout_s)
                else:
                    value = await asyncio.wait_for(in_daemon_thread(tool.function, arguments, deadline),
                                                   self.timeout_s)
        except TimeoutError:
            return ToolResult(name, f"Error: tool {name!r} timed out after {self.timeout_s:g} s.", failed=True,
                              seconds=self.timeout_s)
        except (Exception, SystemExit) as exc:
            return ToolResult(name, f"Error: tool {name!r} raised {type(exc).__name__}: {exc}", failed=True,
                              seconds=time.perf_counter() - start)
        return self._result(name, value, time.perf_counter() - start)

    def _prepare(self, call: ToolCall) -> ToolResult | tuple[Tool, dict[str, Any]]:
        """(tool, arguments cast to its schema) for a call that can run, else the error result for the model."""
        name = call.name
        if name == INVALID_TOOL_NAME:
            raw = call.arguments.get("raw", "")
            why = call.arguments.get("error", "not valid JSON")
            return ToolResult(name, f"Error: could not parse the tool call ({why}). Write it as "
                                    f'<tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>; got: {raw[:300]}',
                              failed=True)
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(name, f"Error: unknown tool {name!r}; the available tools are {sorted(self.tools)}.",
                              failed=True)
        arguments = _coerce_arguments(tool, call.arguments)
        if name not in self._signatures:
            self._signatures[name] = _signature(tool.function)
        bad = _check_arguments(tool, arguments, self._signatures[name])
        if bad is not None:
            return ToolResult(name, f"Error: {bad}.", failed=True)
        return tool, arguments

    def _result(self, name: str, value: Any, seconds: float | None = None) -> ToolResult:
        """The result of a call that returned `value` after `seconds`: content blocks with images keep them."""
        blocks = _content_blocks(value)
        if blocks is None:
            return ToolResult(name, self._text(value), failed=False, seconds=seconds)
        images = tuple(b["image"] for b in blocks if b["type"] == "image")
        parts: list[tuple[str, Any]] = []
        k = 0
        for b in blocks:
            if b["type"] == "image":
                parts.append(("image", k))
                k += 1
            else:
                parts.append(("text", self._text(b.get("text", ""))))
        text = "\n".join(str(t) for kind, t in parts if kind == "text")
        return ToolResult(name, text, failed=False, images=images, parts=tuple(parts), seconds=seconds)

    def _text(self, value: Any) -> str:
        if isinstance(value, str):
            text = value
        elif isinstance(value, dict | list):
            try:
                text = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError):
                text = str(value)
        else:
            text = str(value)
        if self.max_result_chars is not None and len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f"... [truncated, {len(text)} characters]"
        return text


def _content_blocks(value: Any) -> list[dict] | None:
    """`value` as content blocks when it is a list of {"type": "image" | "text"} dicts holding an image (TRL's
    multimodal tool response), else None (the value is rendered as text)."""
    if not isinstance(value, list | tuple) or not value:
        return None
    if not all(isinstance(b, dict) and b.get("type") in ("image", "text") for b in value):
        return None
    if not any(b["type"] == "image" and b.get("image") is not None for b in value):
        return None
    return [b for b in value if b["type"] == "text" or b.get("image") is not None]


def run_turns(turns: Sequence[tuple[ToolRunner, Sequence[ToolCall]]], max_concurrency: int = 64
              ) -> list[list[ToolResult]]:
    """Run the tool calls of many rollouts at once: `turns[i] = (runner of rollout i, its calls)`.

    Every call of every rollout runs concurrently (at most `max_concurrency` at a time), each under its runner's
    timeout; results come back per rollout, in call order. Use this for a batch rather than one `run` per
    rollout: a turn then takes as long as its slowest call, not the sum over rollouts.
    """
    if not any(calls for _, calls in turns):
        return [[] for _ in turns]

    async def main():
        gate = asyncio.Semaphore(max(1, int(max_concurrency)))

        return list(await asyncio.gather(*(runner.arun(calls, _gate=gate) for runner, calls in turns)))

    return run_sync(main())


def tool_metrics(results_per_rollout: Sequence[Sequence[ToolResult]]) -> dict[str, float]:
    """TRL's tool metrics over a batch: `tools/call_frequency` (calls per rollout) and `tools/failure_frequency`
    (failed calls / calls, 0 when there were none)."""
    n = len(results_per_rollout)
    calls = sum(len(r) for r in results_per_rollout)
    failed = sum(x.failed for r in results_per_rollout for x in r)
    return {"tools/call_frequency": calls / n if n else 0.0,
            "tools/failure_frequency": failed / calls if calls else 0.0}

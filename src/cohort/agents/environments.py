"""Environments: stateful tool providers, with TRL 1.16's `environment_factory` semantics.

An environment is an object made by a factory (usually its class) with

- `reset(**row) -> str | None`: called once per rollout before generation with the dataset row (every column;
  with several environments the routing column `environment` is left out). Text it returns is appended to the
  content of the prompt's last message (a text prompt gets it appended directly).
- public methods (names not starting with `_`, other than `reset` and `get_reward`): the rollout's tools, with
  schemas from their signatures and docstrings exactly as for plain tools.
- optionally `get_reward() -> float` (or `async def`): called once per finished rollout; an extra reward source
  with weight 1, logged under the environment's class name. Rollouts of other environments get None for it.

`Environments(factory)` gives every row the same environment; `Environments({"name": factory, ...})` routes
each row by its `environment` column and shows each prompt only its environment's tools (plus the standalone
tools). Instances are pooled: each rollout of a batch gets its own instance (they never share state), and
instances are created once and reset many times, created anew only when a batch needs more at once. One
instance of each environment is made up front, to check it has `reset` and to read its tools.

`environment_factory` may also be an import path, `"pkg.module:Class"`, or a dict of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cohort.agents.tools import Tool, ToolRunner, build_tools
from cohort.data.sources import import_object
from cohort.errors import ConfigError

RESERVED_METHODS = ("reset", "get_reward")
ROUTING_COLUMN = "environment"


def _factory(spec: Any, label: str) -> Callable[[], Any]:
    if isinstance(spec, str):
        spec = import_object(spec)
    if not callable(spec):
        raise ConfigError(f"environment {label!r}: {spec!r} is not a class or a factory; give a class, a "
                          "zero-argument callable returning an environment, or a 'pkg.module:Class' path.")
    return spec


_SCHEMAS: dict[type, list[Tool]] = {}  # schemas by class: read once, then rebound to each instance


def environment_tools(instance: Any) -> list[Tool]:
    """The tools of an environment instance: its public bound methods other than reset/get_reward."""
    cls = type(instance)
    if cls not in _SCHEMAS:
        methods = [member for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
                   if not name.startswith("_") and name not in RESERVED_METHODS]
        try:
            _SCHEMAS[cls] = build_tools(methods)
        except ConfigError as exc:
            raise ConfigError(f"environment {cls.__name__}: {exc}") from exc
    return [Tool(name=t.name, function=getattr(instance, t.function.__name__), schema=t.schema, is_async=t.is_async)
            for t in _SCHEMAS[cls]]


@dataclass
class EnvironmentSession:
    """One rollout's environment: the instance, its tools (standalone + its methods), and what reset returned."""

    name: str | None
    instance: Any
    tools: list[Tool]
    observation: str | list | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def class_name(self) -> str:
        return type(self.instance).__name__

    def runner(self, timeout_s: float = 10.0, **kwargs: Any) -> ToolRunner:
        """A ToolRunner over this rollout's tools; serial (one call at a time, in order) since the calls share the
        instance's state. Several rollouts still run at once through `run_turns`."""
        return ToolRunner(self.tools, timeout_s=timeout_s, serial=True, **kwargs)


class Environments:
    """The environments of a run: validation, routing, per-rollout instances, resets and rewards."""

    def __init__(self, factory: Any, tools: Sequence[Tool | Callable[..., Any] | str] | None = None):
        self.multi = isinstance(factory, Mapping)
        raw = dict(factory) if self.multi else {None: factory}
        if not raw:
            raise ConfigError("environment_factory is an empty dict; give at least one environment.")
        self.factories: dict[str | None, Callable[[], Any]] = {
            name: _factory(spec, str(name or spec)) for name, spec in raw.items()}
        self.standalone_tools = build_tools(list(tools or []))
        self._pool: dict[str | None, list[Any]] = {}
        self.last_sessions: list[EnvironmentSession] = []
        self._tools: dict[str | None, list[Tool]] = {}  # tools by environment (names/schemas of the probe instance)
        self.reward_classes: list[type] = []  # classes with get_reward, one reward column each
        for name, make in self.factories.items():
            instance = make()
            cls = type(instance)
            if not callable(getattr(instance, "reset", None)):
                raise ConfigError(
                    f"environment {cls.__name__} (from {name or 'environment_factory'}) has no reset method; add "
                    f"`def reset(self, **row) -> str | None` to {cls.__name__}: it is called before each rollout "
                    "with the dataset row and may return text appended to the last user message.")
            env_tools = environment_tools(instance)
            names = [t.name for t in self.standalone_tools]
            clash = sorted({t.name for t in env_tools} & set(names))
            if clash:
                raise ConfigError(f"environment {cls.__name__}: its methods {clash} have the names of standalone "
                                  "tools; rename one of them.")
            self._pool[name] = [instance]
            self._tools[name] = self.standalone_tools + env_tools
            if callable(getattr(instance, "get_reward", None)) and cls not in self.reward_classes:
                self.reward_classes.append(cls)

    # -- what the prompt shows --------------------------------------------------------------------------------
    def name_of(self, row: Mapping[str, Any]) -> str | None:
        if not self.multi:
            return None
        name = row.get(ROUTING_COLUMN)
        if name not in self.factories:
            raise ConfigError(f"a row has environment={name!r}, which is not among the environments given "
                              f"({sorted(map(str, self.factories))}); fix the dataset's 'environment' column.")
        return name

    def tools_for(self, row: Mapping[str, Any]) -> list[Tool]:
        """The tools a row's prompt lists (schemas only: bound to the probe instance, not to be called)."""
        return self._tools[self.name_of(row)]

    @property
    def all_tools(self) -> list[Tool]:
        seen: dict[str, Tool] = {}
        for tools in self._tools.values():
            for t in tools:
                seen.setdefault(t.name, t)
        return list(seen.values())

    @property
    def reward_names(self) -> list[str]:
        return [c.__name__ for c in self.reward_classes]

    # -- one batch ----------------------------------------------------------------------------------------------
    def start(self, rows: Sequence[Mapping[str, Any]]) -> list[EnvironmentSession]:
        """One session per rollout (rows repeated per generation): an instance from the pool, reset with its row."""
        cursor: dict[str | None, int] = {}
        sessions = []
        for row in rows:
            name = self.name_of(row)
            pool = self._pool[name]
            i = cursor.get(name, 0)
            if i == len(pool):
                pool.append(self.factories[name]())
            cursor[name] = i + 1
            instance = pool[i]
            kwargs = {k: v for k, v in row.items() if k != ROUTING_COLUMN} if self.multi else dict(row)
            observation = instance.reset(**kwargs)
            if observation is not None and not isinstance(observation, str | list):
                raise ConfigError(f"environment {type(instance).__name__}.reset returned "
                                  f"{type(observation).__name__}; it must return a str (or content parts) or None.")
            tools = self.standalone_tools + environment_tools(instance)
            sessions.append(EnvironmentSession(name=name, instance=instance, tools=tools, observation=observation))
        self.last_sessions = sessions  # the batch's rollouts (the TRL facade's `environments`)
        return sessions

    def rewards(self, sessions: Sequence[EnvironmentSession]) -> dict[str, list[float | None]]:
        """`{class name: [get_reward() or None per rollout]}`: None where the rollout's environment is another class."""
        out: dict[str, list[float | None]] = {}
        for cls in self.reward_classes:
            out[cls.__name__] = [_call_reward(s.instance) if type(s.instance) is cls else None for s in sessions]
        return out

    def reward_functions(self, sessions_key: str = "environments") -> list[Callable[..., list[float | None]]]:
        """TRL-style reward functions, one per class with get_reward, reading `environments=[instances]`."""
        funcs = []
        for cls in self.reward_classes:
            def fn(*, _cls=cls, **kwargs):
                instances = kwargs[sessions_key]
                return [_call_reward(e) if type(e) is _cls else None for e in instances]
            fn.__name__ = cls.__name__
            fn.__qualname__ = cls.__name__
            funcs.append(fn)
        return funcs


def _call_reward(instance: Any) -> float:
    value = instance.get_reward()
    if inspect.isawaitable(value):
        value = _run_coroutine(value)
    return float(value)


def _run_coroutine(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await(coro))
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, _await(coro)).result()


async def _await(x):
    return await x


def append_observation(prompt: Any, observation: str | list | None) -> Any:
    """The prompt with reset's text appended to its last message's content (TRL); a new object, input untouched."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        if not isinstance(observation, str):
            raise ConfigError("reset returned content parts but the prompt is plain text; return a str instead")
        return prompt + observation
    messages = list(prompt)
    if not messages:
        return [{"role": "user", "content": observation}]
    last = dict(messages[-1])
    content = last.get("content") or ""
    if isinstance(observation, list) or isinstance(content, list):  # multimodal content parts (TRL)
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        extra = observation if isinstance(observation, list) else [{"type": "text", "text": observation}]
        last["content"] = [*parts, *extra]
    else:
        last["content"] = content + observation
    messages[-1] = last
    return messages

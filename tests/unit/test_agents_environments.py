"""Environments: TRL 1.16's environment_factory contract (reset, method tools, get_reward, routing, pooling)."""

from __future__ import annotations

import asyncio

import pytest
from transformers.utils import get_json_schema

from cohort.agents.builtins import calculator
from cohort.agents.environments import Environments, append_observation
from cohort.agents.tools import ToolCall, ToolRunner
from cohort.errors import ConfigError


class Counter:
    made = 0

    def __init__(self):
        Counter.made += 1
        self.value = 0
        self.target = None

    def reset(self, target: int = 0, **row) -> str:
        self.value = 0
        self.target = target
        return f" Reach {target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add.
        """
        self.value += by
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0

    def _private(self):
        return "not a tool"


class Echo:
    def reset(self, **row) -> None:
        self.row = row

    async def shout(self, text: str) -> str:
        """Shout the text back.

        Args:
            text: What to shout.
        """
        await asyncio.sleep(0)
        return text.upper()


class NoReset:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: The input.
        """
        return x


class Undocumented:
    def reset(self, **row):
        return None

    def act(self, x):
        return x


def test_reset_text_is_appended_and_tools_are_the_public_methods():
    envs = Environments(Counter, tools=[calculator])
    assert [t.name for t in envs.tools_for({})] == ["calculator", "increment"]
    assert envs.tools_for({})[1].schema == get_json_schema(Counter().increment)
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "Count."}]
    rows = [{"prompt": prompt, "target": 3}, {"prompt": prompt, "target": 5}]
    sessions = envs.start(rows)
    assert [s.observation for s in sessions] == [" Reach 3.", " Reach 5."]
    assert append_observation(prompt, sessions[0].observation)[-1] == {"role": "user", "content": "Count. Reach 3."}
    assert prompt[-1]["content"] == "Count."  # the row is left untouched
    assert append_observation("Count.", " Reach 3.") == "Count. Reach 3."
    assert append_observation(prompt, None) is prompt
    # each rollout calls its own instance
    out = ToolRunner(sessions[0].tools).run([ToolCall("increment", {"by": 3}), ToolCall("calculator", {"expression": "1+1"})])
    assert [r.content for r in out] == ["3", "2"]
    ToolRunner(sessions[1].tools).run([ToolCall("increment", {"by": 4})])
    assert envs.rewards(sessions) == {"Counter": [1.0, 0.0]}
    assert envs.reward_names == ["Counter"]
    (fn,) = envs.reward_functions()
    assert fn.__name__ == "Counter" and fn(environments=[s.instance for s in sessions], prompts=[]) == [1.0, 0.0]


def test_instances_are_pooled_one_per_rollout():
    Counter.made = 0
    envs = Environments(Counter)
    assert Counter.made == 1  # the probe
    first = envs.start([{"target": 1}] * 4)
    assert Counter.made == 4 and len({id(s.instance) for s in first}) == 4
    second = envs.start([{"target": 2}] * 3)
    assert Counter.made == 4  # reused, reset
    assert [s.instance for s in second] == [s.instance for s in first[:3]]
    assert all(s.instance.target == 2 and s.instance.value == 0 for s in second)


def test_routing_by_environment_column():
    envs = Environments({"count": Counter, "echo": "tests.unit.test_agents_environments:Echo"})
    assert [t.name for t in envs.tools_for({"environment": "echo"})] == ["shout"]
    rows = [{"environment": "count", "target": 2, "prompt": "p"}, {"environment": "echo", "prompt": "p", "k": 1}]
    sessions = envs.start(rows)
    assert [s.class_name for s in sessions] == ["Counter", "Echo"]
    assert sessions[1].instance.row == {"prompt": "p", "k": 1}  # the routing column is not passed to reset
    assert sessions[1].observation is None
    assert ToolRunner(sessions[1].tools).run([ToolCall("shout", {"text": "hi"})])[0].content == "HI"
    assert ToolRunner(sessions[1].tools).run([ToolCall("increment", {"by": 1})])[0].failed  # not its tool
    ToolRunner(sessions[0].tools).run([ToolCall("increment", {"by": 2})])
    assert envs.rewards(sessions) == {"Counter": [1.0, None]}  # Echo has no get_reward: None for its rollouts
    assert {t.name for t in envs.all_tools} == {"increment", "shout"}
    with pytest.raises(ConfigError, match="environment='nope'"):
        envs.start([{"environment": "nope"}])


def test_single_environment_gets_the_whole_row():
    envs = Environments(Echo)
    (s,) = envs.start([{"environment": "kept", "x": 1}])
    assert s.instance.row == {"environment": "kept", "x": 1}  # TRL: only a dict of environments routes


def test_environment_without_reset_is_a_config_error():
    with pytest.raises(ConfigError, match=r"NoReset.*reset"):
        Environments(NoReset)
    with pytest.raises(ConfigError, match="NoReset"):
        Environments({"a": Counter, "b": NoReset})


def test_undocumented_method_names_the_environment():
    with pytest.raises(ConfigError, match=r"Undocumented.*act"):
        Environments(Undocumented)


def test_bad_factories():
    with pytest.raises(ConfigError, match="not a class or a factory"):
        Environments(42)
    with pytest.raises(ConfigError, match="empty"):
        Environments({})

    class Clash(Counter):
        def calculator(self, expression: str) -> str:
            """Clash.

            Args:
                expression: e.
            """
            return expression

    with pytest.raises(ConfigError, match="calculator"):
        Environments(Clash, tools=[calculator])


def test_async_get_reward():
    class AsyncReward(Echo):
        async def get_reward(self) -> float:
            await asyncio.sleep(0)
            return 0.5

    envs = Environments(AsyncReward)
    assert envs.rewards(envs.start([{}, {}])) == {"AsyncReward": [0.5, 0.5]}


def test_session_runner_is_serial_and_run_turns_mixes_rollouts():
    from cohort.agents.tools import run_turns

    envs = Environments(Counter)
    a, b = envs.start([{"target": 3}, {"target": 3}])
    assert a.runner().serial
    out = run_turns([(a.runner(), [ToolCall("increment", {"by": 1}), ToolCall("increment", {"by": 2})]),
                     (b.runner(), [ToolCall("increment", {"by": "5"})])])
    assert [[r.content for r in rs] for rs in out] == [["1", "3"], ["5"]]  # in order; "5" cast to int
    assert envs.rewards([a, b]) == {"Counter": [1.0, 0.0]}


def test_content_part_observations():
    prompt = [{"role": "user", "content": "Look."}]
    parts = [{"type": "text", "text": " More."}]
    assert append_observation(prompt, parts)[-1]["content"] == [{"type": "text", "text": "Look."}, *parts]
    multimodal = [{"role": "user", "content": [{"type": "image"}]}]
    assert append_observation(multimodal, " Hi")[-1]["content"] == [{"type": "image"}, {"type": "text", "text": " Hi"}]
    with pytest.raises(ConfigError, match="plain text"):
        append_observation("Look.", parts)

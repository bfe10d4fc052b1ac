"""What scores a run's rollouts and drives multi-turn ones: the reward functions named in `reward.funcs`,
agent environments (`agent.environment_factory`, whose get_reward adds reward functions) and the tool-calling
turn loop (`agent.tools`). Unknown names and malformed environments fail here, before any model loads.
"""

from __future__ import annotations

from cohort.agents.environments import Environments
from cohort.agents.rollout_loop import TurnLoop
from cohort.agents.templates import check_renders_tools
from cohort.config import CohortConfig
from cohort.data.sources import import_object
from cohort.errors import ConfigError
from cohort.rewards import RewardRunner, get_reward_function
from cohort.vision.conversation import VisionTurns


def build_reward_runner(cfg: CohortConfig) -> RewardRunner:
    """reward.funcs (names, {name: kwargs} mappings or callables) with their weights, timeout and on_error."""
    funcs = []
    for spec in cfg.reward.funcs:
        if isinstance(spec, dict):
            if len(spec) != 1:
                raise ConfigError(f"reward.funcs entry {spec!r} must be a name or a one-key mapping "
                                  "{name: {kwargs}}.")
            (name, kwargs), = spec.items()
            funcs.append(get_reward_function(name, **(kwargs or {})))
        else:
            funcs.append(spec if callable(spec) else get_reward_function(spec))
    # with environments, the rewards may all be theirs (get_reward, added by with_environment_rewards)
    return RewardRunner(funcs, cfg.reward.reward_weights, timeout_s=cfg.reward.timeout_s,
                        on_error=cfg.reward.on_error, allow_empty=cfg.agent.environment_factory is not None)


def build_environments(cfg: CohortConfig):
    """agent.environment_factory: the run's `Environments` (one probe instance of each, so an environment without
    `reset` or with a tool method lacking hints/docstring fails here, before any model loads); None without."""
    if cfg.agent.environment_factory is None:
        return None
    return Environments(cfg.agent.environment_factory, tools=list(cfg.agent.tools))


def with_environment_rewards(runner, environments):
    """TRL 1.16: each environment class with get_reward is one more reward function (weight 1, named after the
    class), reading the `environments` column (each rollout's instance); its column reaches the advantages.
    The runner keeps its kind (`with_functions`); a run left with no reward function at all fails here."""
    funcs = environments.reward_functions() if environments is not None else []
    if funcs:
        runner = runner.with_functions(funcs)
    if not list(runner.funcs):
        raise ConfigError("no reward function: reward_funcs is empty and no environment class has a get_reward "
                          "method; give reward_funcs, or a get_reward() -> float on the environment.")
    return runner


def build_turn_loop(cfg: CohortConfig, tokenizer, environments=None, processor=None):
    """agent.tools (or agent.environment_factory): the turn loop that runs them between model turns; None
    without tools (single-turn). With environments, every rollout calls its own instance's methods. processor:
    a vision-language model's, so that images a tool returns reach the model (cohort.vision.conversation)."""
    a = cfg.agent
    if not a.tools and environments is None:
        return None
    check_renders_tools(tokenizer)  # model.chat_template=chatml_tools gives a model without tool support one
    tools = environments.all_tools if environments is not None else list(a.tools)
    return TurnLoop(tokenizer, tools, max_iterations=cfg.generation.max_tool_calling_iterations,
                    tool_timeout_s=a.tool_timeout_s, parser=import_object(a.tool_parser) if a.tool_parser else None,
                    environments=environments, inline_tools=a.inline_tools,
                    malformed_tool_calls=a.malformed_tool_calls,
                    vision=VisionTurns(processor) if processor is not None else None)

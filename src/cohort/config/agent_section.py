"""The `agent` section of a run's config (tool calling and environments), beside the other sections of
`cohort.config.sections`, with the same `setting(default, help=...)` fields."""

# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from cohort.config.sections import setting


@dataclass
class AgentConfig:
    """Tool calling: with tools, each completion may call them, get the results and continue (multi-turn);
    the tool results are context, never trained on. Empty tools: plain single-turn completions."""

    tools: list[Any] = setting(
        default_factory=list, help='functions or "pkg.module:function" paths the model may call; empty: no tools')
    tool_timeout_s: float = setting(
        10.0, help="per call, in seconds; a call that runs longer gets an error message instead")
    tool_parser: str | None = setting(
        None, help='"pkg.module:function"(text, tokenizer) -> list[ToolCall]; None: cohort.agents.parse_tool_calls')
    environment_factory: Any = setting(
        None, help="TRL's environment_factory: \"pkg.module:Class\" (or a class / zero-argument factory), or {name: "
                   "that} routed by the dataset's `environment` column. Each rollout gets its own instance: "
                   "reset(**row) before it, its methods as the rollout's tools, get_reward() (if defined) as one "
                   "more reward column (weight 1). None: no environments")
    inline_tools: bool | Literal["auto"] = setting(
        "auto", help="where a turn's tool calls run and their results are rendered. true: on the engine's thread "
                     "as each turn ends, faster for tools that answer in about a millisecond (a calculator), "
                     "but a slow tool stalls generation while it runs; false: on a thread pool while the engine "
                     "generates the other completions; auto: on the engine's thread while each call takes under "
                     "2 ms, and on the pool for a tool once 2 calls in a row took longer or one took over 50 ms "
                     "(async tools and tools marked cohort.agents.slow_tool start there), logged once per tool; "
                     "see cohort.agents.placement")
    malformed_tool_calls: Literal["feedback", "end"] = setting(
        "feedback", help="a tool call the parser cannot read (bad JSON, no name): feedback: the model gets an error "
                         "message as that call's result (a failed call) and continues; end: it is no call, and a "
                         "turn with no other call ends the completion (TRL's behaviour; the TRL facade's default)")

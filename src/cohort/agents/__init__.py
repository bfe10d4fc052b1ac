"""Agent training: tools, tool-call parsing, chat messages for tool results, environments, built-in tools.

The turn loop in the rollout uses these pieces: `build_tools` / `Environments` describe what the model may call,
`parse_tool_calls` reads its calls, `ToolRunner` executes them, `tool_result_messages` and `continuation_ids`
turn the results into the tokens that continue the sequence. See docs/agents.md.
"""

from cohort.agents.environments import Environments, EnvironmentSession, append_observation
from cohort.agents.messages import assistant_message, continuation_ids, tool_result_messages
from cohort.agents.parsing import parse_tool_calls
from cohort.agents.placement import slow_tool
from cohort.agents.templates import CHATML_TOOLS, apply_chat_template_override, check_renders_tools
from cohort.agents.tools import (
    Tool,
    ToolCall,
    ToolResult,
    ToolRunner,
    build_tools,
    run_turns,
    tool_metrics,
    tool_schemas,
)

__all__ = [
    "CHATML_TOOLS", "EnvironmentSession", "Environments", "Tool", "ToolCall", "ToolResult", "ToolRunner",
    "append_observation", "apply_chat_template_override", "assistant_message", "build_tools",
    "check_renders_tools", "continuation_ids", "parse_tool_calls", "run_turns", "slow_tool", "tool_metrics",
    "tool_result_messages", "tool_schemas",
]

"""The tool-calling turn loop: multi-turn rollouts on an engine's `generate_turns`.

`TurnLoop.generate(engine, prompt_ids, params, prompts)` returns what `engine.generate` returns, with each
completion holding the whole conversation after the prompt (model turns and the tool results between them),
its per-token loss mask (1 for the model's tokens, 0 for tool results), its tool counts and its chat
messages (assistant turns with their tool_calls, tool results: what rewards read). Whenever a
completion ends a turn, the loop:

1. parses the turn's tool calls (`parse_tool_calls`; none: the conversation is over);
2. runs them (`ToolRunner`: the calls of one turn concurrently, each under `tool_timeout_s`; errors and
   timeouts become error messages for the model and count as failures);
3. renders the results as tool messages and tokenises them as the continuation of the model's own sequence
   (`continuation_ids`: the chat template's tool-result block and the next assistant header);
4. hands those ids back to the engine, which prefills only them on the sequence's kept KV blocks.

The turns that end in one engine step come in one call (`engine.generate_turns` calls the callback's `many`):
their calls (those of one tool runner) run at once, one hand-off to the tool workers instead of one per turn,
while the engine's next decode launch, queued before the callback, runs on the device.

Steps 2-3 run at once on the engine's own thread, between two engine steps (inline), or on a thread pool while
the engine keeps generating the other sequences. Inline is faster for quick tools (a calculator): the pool's
workers hold the GIL while rendering the chat template, and every PyTorch call of the engine's loop releases
the GIL and may then wait a whole switch interval (5 ms) to get it back; but a slow tool stalls the engine for
as long as it runs. `inline_tools` chooses: True, False, or "auto" (the default), inline while the tools are
quick and on the pool for a tool once a call of it was slow (`cohort.agents.placement`). A conversation also
ends after `max_iterations` rounds of tool calls, or when the tool results would not leave room for another
token within the completion budget (`params.max_tokens`, over the whole conversation): then they are dropped
and the completion ends as the model left it, as TRL does.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from cohort.agents.messages import (
    MessageLog,
    assistant_message,
    continuation_ids,
    continuation_text,
    end_of_turn_ids,
    tool_result_messages,
)
from cohort.agents.parsing import parse_tool_calls
from cohort.agents.placement import AUTO, GcClock, ToolPlacement
from cohort.agents.tools import INVALID_TOOL_NAME, ToolRunner, build_tools
from cohort.types import Completion, SamplingParams, TurnEnd


@dataclass
class _Conversation:
    """One rollout's chat so far (the prompt's messages, then assistant and tool messages) and its counts."""

    messages: list[dict[str, Any]]
    calls: int = 0
    failures: int = 0
    # (calls, results, the turn's text) per turn that made calls; the text is decoded once, for the messages too
    rounds: list[tuple[list, list, str]] = field(default_factory=list)
    contexts: list[list[int]] = field(default_factory=list)  # the continuations handed back, in order


@dataclass
class TurnLoop:
    """Multi-turn tool calling over an engine that implements `generate_turns` (both built-in engines do).

    tools: functions, `cohort.agents.Tool`s or `"pkg.module:function"` paths.
    max_iterations: rounds of tool calls per completion (TRL's max_tool_calling_iterations); None = no cap
        but the completion budget.
    parser: `parser(text, tokenizer) -> list[ToolCall]`; default `cohort.agents.parse_tool_calls`.
    runner: anything with `run(calls) -> list[ToolResult]`; default `ToolRunner(tools, tool_timeout_s)`.
    template_kwargs: extra chat template variables (e.g. enable_thinking=False), as for the prompts.
    environments: an `Environments` (environment_factory); `cohort.rollout.generate_in_environments` uses it.
    inline_tools: True: run the tools and build the continuation on the engine's thread as each turn ends (no
        thread pool; see the module docstring), for tools that return in about a millisecond; False: on the
        pool; "auto": inline while each call takes under 2 ms, on the pool for a tool that proved slow
        (`cohort.agents.placement`; `placement.modes` says where each tool runs and why).
    """

    tokenizer: Any
    tools: Sequence[Any]
    max_iterations: int | None = None
    tool_timeout_s: float = 10.0
    parser: Callable[..., list] | None = None
    runner: Any = None
    max_workers: int = 16
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # environment_factory (cohort.agents.environments.Environments): each rollout gets its own instance, reset
    # with its row; the rollout (cohort.rollout) hands each completion its instance's runner. None: plain tools.
    environments: Any = None
    inline_tools: bool | str = AUTO
    # agent.malformed_tool_calls: "feedback" hands the model an error for a call the parser could not read;
    # "end" drops such calls (TRL), so a turn with no readable call ends the completion
    malformed_tool_calls: str = "feedback"
    # a vision-language model (cohort.vision.conversation.VisionTurns): tool results with images are rendered by
    # its processor's chat template and expanded by the processor, and each completion carries their images to
    # the update (Completion.context_inputs); None: a text model (a tool's images are announced, not shown)
    vision: Any = None

    def __post_init__(self) -> None:
        # the agents package is imported here, not at module level: the engine and rollout never need it
        self.tools = build_tools(list(self.tools))
        if self.runner is None:
            self.runner = ToolRunner(self.tools, timeout_s=self.tool_timeout_s)
        if self.parser is None:
            self.parser = functools.partial(parse_tool_calls, tools=self.tools)
        # a turn that ends on one of these closed itself; any other ending (a stop string) did not
        self._end_of_turn_ids = end_of_turn_ids(self.tokenizer)
        self.placement = ToolPlacement(self.inline_tools, self.tools)

    def generate(self, engine, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 prompts: Sequence[Any] | None = None, runners: Sequence[Any] | None = None) -> list[list[Completion]]:
        """`params.n` multi-turn completions per prompt (`engine.generate`'s layout), with masks and tool counts.
        `prompts`: the prompts as messages (or text), the start of each conversation the template renders.
        `runners`: one tool runner per completion (prompt-major: completion j of prompt i is i * n + j), e.g.
        `ToolRunner(session.tools)` of each rollout's own environment; None: the loop's runner for all."""
        if runners is not None and len(runners) != len(prompt_ids) * params.n:
            raise ValueError(f"got {len(runners)} tool runners for {len(prompt_ids)} prompts x n={params.n}; "
                             "give one per completion.")
        convs = {(i, j): _Conversation(MessageLog(_prompt_messages(prompts[i] if prompts is not None else None)))
                 for i in range(len(prompt_ids)) for j in range(params.n)}
        with ThreadPoolExecutor(self.max_workers, thread_name_prefix="cohort-turns") as pool:
            groups = engine.generate_turns(prompt_ids, params, _TurnEnds(self, convs, runners, params, pool))
        for i, group in enumerate(groups):
            for j, completion in enumerate(group):
                conv = convs[(i, j)]
                completion.tool_calls, completion.tool_failures = conv.calls, conv.failures
                completion.messages = self._messages(completion, conv)
                if self.vision is not None:
                    completion.context_inputs = self.vision.completion_inputs(conv.contexts, completion.token_ids,
                                                                              completion.mask)
        return groups

    def _messages(self, completion: Completion, conv: _Conversation) -> list[dict[str, Any]]:
        """The completion as chat messages: each model turn (with the calls it made), then its tool results.
        Turn k made the k-th round of calls, if any; the last turn's results are absent when they did not fit."""
        # each turn: a run of sampled tokens (mask 1); found by the regex engine, not a Python loop per token
        spans = [m.span() for m in _SAMPLED_RUN.finditer(bytes(completion.mask or []))]
        out: list[dict[str, Any]] = []
        for k, (a, b) in enumerate(spans):
            if k < len(conv.rounds):
                calls, results, text = conv.rounds[k]
            else:
                calls, results, text = [], [], self.tokenizer.decode(completion.token_ids[a:b], skip_special_tokens=True)
            out.append(assistant_message(text, calls))
            if k + 1 < len(spans):
                out += tool_result_messages(results, with_images=self.vision is not None)
        return out

    def _run_tools(self, conv: _Conversation, turn: TurnEnd, calls: list, max_tokens: int,
                   lock: threading.Lock, runner, timed: bool = False) -> list[int] | None:
        """Runs on the pool or inline: execute the calls, return the continuation ids (None when they do not
        fit). timed (inline): the calls' duration goes to the placement (agent.inline_tools=auto)."""
        if timed:
            ((_, _, _, _, results),) = self._run_inline([(0, conv, turn, calls, runner)])
        else:
            results = runner.run(calls)
        return self._continuation(conv, turn, calls, results, max_tokens, lock)

    def _run_inline(self, items: list[tuple]) -> list[tuple]:
        """Run the calls of several turns (k, conv, turn, calls, runner) on the engine's thread, those of one
        runner in one `run` (its calls run at once, each under the timeout); each turn's calls and the
        duration go to the placement (agent.inline_tools=auto). Returns (k, conv, turn, calls, results)."""
        by_runner: dict[int, list[tuple]] = {}
        for item in items:
            by_runner.setdefault(id(item[4]), []).append(item)
        out = []
        for group in by_runner.values():
            flat = [call for item in group for call in item[3]]
            start = time.perf_counter()
            with GcClock() as collector:
                results = group[0][4].run(flat)
            seconds = time.perf_counter() - start
            at = 0
            for k, conv, turn, calls, _ in group:
                mine = results[at: at + len(calls)]
                at += len(calls)
                self.placement.record(calls, mine, seconds, collector.seconds)
                out.append((k, conv, turn, calls, mine))
        return out

    def _continuation(self, conv: _Conversation, turn: TurnEnd, calls: list, results: list, max_tokens: int,
                      lock: threading.Lock) -> list[int] | None:
        """Book a turn's calls and results in its conversation and render the continuation ids (None when they do
        not fit the completion budget)."""
        text = self.tokenizer.decode(turn.turn_ids, skip_special_tokens=True)
        with lock:  # counts are per conversation, but keep the increments plainly atomic
            conv.calls += len(results)
            conv.failures += sum(1 for r in results if r.failed)
            conv.rounds.append((list(calls), list(results), text))
        conv.messages.append(assistant_message(text, calls))
        new = tool_result_messages(results, with_images=self.vision is not None)
        close_turn = not turn.turn_ids or turn.turn_ids[-1] not in self._end_of_turn_ids
        images = [image for r in results for image in r.images] if self.vision is not None else []
        if images:  # the processor's template places them, the processor expands each into its image tokens
            text = continuation_text(self.tokenizer, conv.messages, new, self.tools, close_turn=close_turn,
                                     renderer=self.vision.renderer, **self.template_kwargs)
            ids = self.vision.encode(text, images)
        else:
            ids = continuation_ids(self.tokenizer, conv.messages, new, self.tools, close_turn=close_turn,
                                   **self.template_kwargs)
        if len(turn.completion_ids) + len(ids) >= max_tokens:
            return None  # no room for the results and another turn: end as the model left it (TRL drops them)
        conv.messages.extend(new)
        if ids:  # an empty continuation ends the conversation (no span in the completion)
            conv.contexts.append(ids)
        return ids


class _TurnEnds:
    """The engine's turn callback for one `TurnLoop.generate` call: `turn_ends(turn)` for one turn, and
    `turn_ends.many(turns)` for the turns that ended in one engine step (the engine calls that one when it can:
    the inline turns' calls then run at once, one hand-off to the tool workers for all of them)."""

    def __init__(self, loop: TurnLoop, convs: dict, runners: Sequence[Any] | None, params: SamplingParams,
                 pool: ThreadPoolExecutor) -> None:
        self.loop, self.convs, self.runners, self.params, self.pool = loop, convs, runners, params, pool
        self.lock = threading.Lock()

    def _calls(self, turn: TurnEnd) -> list:
        """The turn's tool calls to run (none: the conversation is over)."""
        loop = self.loop
        if loop.max_iterations is not None and turn.turn > loop.max_iterations:
            return []
        assert loop.parser is not None  # TurnLoop.__post_init__ sets the default parser
        calls = loop.parser(loop.tokenizer.decode(turn.turn_ids, skip_special_tokens=False), loop.tokenizer)
        if loop.malformed_tool_calls == "end":
            calls = [c for c in calls if c.name != INVALID_TOOL_NAME]
        return calls

    def _where(self, turn: TurnEnd) -> tuple[_Conversation, Any]:
        """The turn's conversation and tool runner."""
        conv = self.convs[(turn.prompt_index, turn.sample_index)]
        if self.runners is None:
            return conv, self.loop.runner
        return conv, self.runners[turn.prompt_index * self.params.n + turn.sample_index]

    def _submit(self, conv: _Conversation, turn: TurnEnd, calls: list, runner: Any):
        return self.pool.submit(self.loop._run_tools, conv, turn, calls, self.params.max_tokens, self.lock, runner)

    def __call__(self, turn: TurnEnd):
        calls = self._calls(turn)
        if not calls:
            return None
        conv, runner = self._where(turn)
        if self.loop.placement.inline(calls):
            return self.loop._run_tools(conv, turn, calls, self.params.max_tokens, self.lock, runner, timed=True)
        return self._submit(conv, turn, calls, runner)

    def many(self, turns: list[TurnEnd]) -> list:
        replies: list = [None] * len(turns)
        inline = []
        for k, turn in enumerate(turns):
            calls = self._calls(turn)
            if not calls:
                continue
            conv, runner = self._where(turn)
            if self.loop.placement.inline(calls):
                inline.append((k, conv, turn, calls, runner))
            else:
                replies[k] = self._submit(conv, turn, calls, runner)
        for k, conv, turn, calls, results in self.loop._run_inline(inline):
            replies[k] = self.loop._continuation(conv, turn, calls, results, self.params.max_tokens, self.lock)
        return replies


_SAMPLED_RUN = re.compile(b"\x01+")


def _prompt_messages(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, list):
        return [dict(m) for m in prompt]
    return [{"role": "user", "content": "" if prompt is None else str(prompt)}]

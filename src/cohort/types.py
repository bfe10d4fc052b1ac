"""Typed records passed between the stages of a GRPO step.

prompts -> RolloutEngine.generate -> Completion (per prompt, n of them) -> rewards -> advantages
-> RolloutBatch (cohort.rollout) -> packed micro-batches and LossInputs (cohort.update) -> policy update.

Every engine (the reference Hugging Face `generate` backend and cohort's own paged engine) implements the
`RolloutEngine` protocol, so the trainer never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions. Names follow vLLM / TRL.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1` and `min_p == 0` disable those filters.
    The logprob an engine reports for a sampled token is `log_softmax(logits / temperature)[token]` on the
    raw model logits (temperature 1 when greedy): exactly what the trainer recomputes, so the two can be
    compared token by token. top-k/top-p/min-p/repetition penalty shape *which* token is drawn, not the
    reported logprob (TRL and verl recompute logprobs the same way).
    """

    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """Temperature the reported logprobs are computed at (1.0 for greedy decoding)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Completion:
    """One sampled completion of one prompt.

    token_ids: the generated tokens, the stop token included when it is EOS / a stop token id. A multi-turn
        completion holds the whole conversation after the prompt: model turns and the context between them.
    logprobs: one float per token in token_ids (see SamplingParams for which distribution); 0.0 on context.
    finish_reason: "stop" (EOS, stop token or stop string) or "length" (max_tokens reached).
    mask: per token, 1 if the model sampled it and 0 for context (tool results): what the loss trains on.
        None means every token is the model's (single-turn generation).
    turns: model turns in the completion; tool_calls / tool_failures: counted by the tool-calling turn
        loop (None when the rollout had no tools).
    messages: the completion as chat messages (assistant turns with their tool_calls, tool results), set by
        the turn loop; what reward functions get for conversational prompts (TRL's format). None otherwise.
    version: the policy version that sampled it (a served engine's pushed version, cohort.serving); None for
        an in-process engine, which always samples with the current weights.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    mask: list[int] | None = None
    turns: int = 1
    tool_calls: int | None = None
    tool_failures: int = 0
    messages: list[dict] | None = None
    version: int | None = None


@dataclass(frozen=True)
class TurnEnd:
    """A completion that just ended a model turn (EOS / stop), as a multi-turn callback sees it.

    prompt_index, sample_index: where it lands in the result (completion `sample_index` of prompt
    `prompt_index`). completion_ids: everything after the prompt so far; turn_ids: the tokens of the turn that
    just ended (its tail); turn: 1 for the first model turn.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    turn_ids: list[int]
    turn: int
    finish_reason: FinishReason


# What a turn callback returns: the context tokens to append before the next model turn, None to end the
# conversation, or a Future of either (the engine keeps generating the other sequences while it resolves).
TurnCallback = Callable[[TurnEnd], "list[int] | Future | None"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator.

    generate: for each prompt (a list of token ids), `params.n` completions, in prompt order; result[i][j]
    is the j-th completion of prompt i. Per-request seeds: completion j of prompt i uses
    `params.seed + i * params.n + j` when a seed is given, so results do not depend on batching.
    sync_weights: called after every optimizer step. An engine that reads the policy's parameters in place
    does nothing; one that keeps fused copies refreshes them here.
    Both built-in engines also have `generate_turns(prompts, params, on_turn_end)` for multi-turn (tool
    calling) rollouts; see `TurnEnd` and `cohort.engine.CohortEngine.generate_turns`.
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]: ...

    def sync_weights(self) -> None: ...


@runtime_checkable
class PromptWithInputs(Protocol):
    """A prompt (its token ids, as a list) that carries model inputs besides them: images, for the vision
    plug-in's `VisionPrompt`. Text-only layers only ask whether a prompt is one; the plug-in that made it
    registers the forwards that consume it (`cohort.forward.plugins`, `cohort.engine.models.registry`)."""

    def model_inputs(self, device=None) -> dict: ...


@dataclass
class TrainerState:
    """What reward functions receive as `trainer_state`, shaped like TRL's (attribute `global_step`), and
    readable as a mapping too (`state["global_step"]`), for curricula or step-dependent shaping."""

    global_step: int
    max_steps: int
    is_eval: bool = False

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

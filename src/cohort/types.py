"""Typed records passed between the stages of a GRPO step.

prompts -> RolloutEngine.generate -> Completion (per prompt, n of them) -> rewards -> advantages
-> RolloutBatch (made by cohort.rollout) -> packed micro-batches and LossInputs (cohort.update) -> policy update.

Every engine (the reference Hugging Face `generate` backend and cohort's own paged engine) implements the
`RolloutEngine` protocol, so the trainer never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

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
    version: the policy version that sampled it (a served engine's pushed version, cohort.serving; the oldest
        token's with asynchronous rollouts, cohort.streaming); None for an in-process engine sampling with the
        current weights.
    token_versions: per token, the policy version that sampled it, when tokens of one completion may differ
        (asynchronous rollouts: a sequence continues with new weights); None: every token has `version`.
    routed_experts: router replay (train.router_replay): the top-k experts each sparse layer of a mixture-of-experts
        engine chose for every token it fed, a [prompt + completion tokens - 1, sparse layers, k] integer array (row p:
        position p of prompt + completion; the last token never runs). None when the engine records none.
    context_inputs: model inputs in the completion's context (the images a tool returned to a vision-language
        model): an object whose `training_prompt(prompt_ids)` is the prompt that carries them to the update
        (cohort.vision.conversation.ToolImages); None otherwise.
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
    routed_experts: Any = None
    token_versions: list[int] | None = None
    context_inputs: Any = None


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
# A callback may also have `many(turns: list[TurnEnd]) -> list[reply]`, one reply per turn, which the engine
# calls instead with every turn that ended in one step (cohort.agents.TurnLoop runs their tools at once).
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


# The engine's optional abilities, each a Protocol; the trainer reads them once at set-up (`EngineAbilities.of`)
@runtime_checkable
class MultiTurnEngine(Protocol):
    """Continues a completion on its own KV blocks after a turn ends (tool calls): see `TurnEnd`."""

    def generate_turns(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       on_turn_end: TurnCallback) -> list[list[Completion]]: ...


@runtime_checkable
class VersionedEngine(Protocol):
    """Samples with pushed weight versions (a `cohort serve` server): `version` counts pushes, `last_push`
    times the latest one (send_s, apply_s)."""

    version: int
    last_push: dict[str, float]


@runtime_checkable
class KVReleasingEngine(Protocol):
    """Can free its KV-cache pool while the policy updates; its next generate takes it back."""

    def release_kv_cache(self) -> None: ...


@runtime_checkable
class GatheringEngine(Protocol):
    """Samples from a full copy of sharded (FSDP) weights: `weights.seconds` is the last gather's time."""

    weights: Any


@dataclass(frozen=True)
class EngineAbilities:
    """What an engine can do besides `RolloutEngine`, checked once when the run is set up. (Prompts with images
    are not an ability here: the vision plug-in registers the engine family that takes them.)"""

    multi_turn: bool = False
    versioned: bool = False
    releases_kv: bool = False
    gathers_weights: bool = False

    @classmethod
    def of(cls, engine: object) -> EngineAbilities:
        return cls(multi_turn=isinstance(engine, MultiTurnEngine), versioned=isinstance(engine, VersionedEngine),
                   releases_kv=isinstance(engine, KVReleasingEngine),
                   gathers_weights=isinstance(engine, GatheringEngine))


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


@dataclass
class RolloutBatch:
    """What the rollout half of a step hands the update: N = prompts x G completions, groups contiguous
    (completions [k * G, (k + 1) * G) share prompt k). Lists are per completion. The update needs nothing
    else from the rollout: group_size says how rows form groups, the masks say which tokens train."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampling_logprobs: list[list[float]]
    finish_reasons: list[str]
    completions_text: list[str]
    prompts: list[Any]
    rewards_per_func: torch.Tensor  # [N, F], NaN where a function returned None
    rewards: torch.Tensor  # [N] combined
    advantages: torch.Tensor  # [N]
    loss_mask_keep: list[bool]  # False: completion masked out of the loss (e.g. truncated)
    group_size: int  # G, the completions per prompt (rows k * G .. k * G + G - 1 are prompt k's group)
    metrics: dict[str, float] = field(default_factory=dict)
    # per completion, 1 for the model's tokens and 0 for context (tool results); None (or a None row): all 1
    completion_masks: list[list[int] | None] | None = None
    # per-sample columns reward functions logged with log_extra (TRL 1.16), written with the sample rows
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    # per completion, the policy version that sampled it (a served engine, cohort.remote); None in process
    policy_versions: list[int | None] | None = None
    # per completion, the engine's recorded routing (Completion.routed_experts; train.router_replay); None: none
    routed_experts: list[Any] | None = None
    # per completion, per token, the policy version that sampled it (Completion.token_versions); None: none
    token_versions: list[list[int] | None] | None = None

    def __len__(self) -> int:
        return len(self.completion_ids)

    def token_mask(self, i: int) -> list[int]:
        """Completion i's per-token loss mask: all 0 when it is masked out (loss_mask_keep), else 1 on the
        tokens the model sampled (every token of a single-turn completion) and 0 on context tokens."""
        n = len(self.completion_ids[i])
        if not self.loss_mask_keep[i]:
            return [0] * n
        mask = self.completion_masks[i] if self.completion_masks is not None else None
        return [1] * n if mask is None else list(mask)

    def loss_token_count(self, i: int) -> int:
        """sum(token_mask(i)) without building the list (the update counts every row's tokens up front)."""
        if not self.loss_mask_keep[i]:
            return 0
        mask = self.completion_masks[i] if self.completion_masks is not None else None
        return len(self.completion_ids[i]) if mask is None else int(sum(mask))

    def all_tokens_trained(self, i: int) -> bool:
        """True when token_mask(i) is all 1 by construction (kept, no per-token mask: a single-turn completion),
        so the update can fill its row without building the list; False says nothing (read token_mask)."""
        return bool(self.loss_mask_keep[i]) and (self.completion_masks is None or self.completion_masks[i] is None)

"""Typed records passed between the stages of a GRPO step.

prompts -> RolloutEngine.generate -> Completion (per prompt, n of them) -> rewards -> advantages
-> RolloutBatch (cohort.rollout) -> packed micro-batches and LossInputs (cohort.update) -> policy update.

Every engine (the reference Hugging Face `generate` backend and cohort's own paged engine) implements the
`RolloutEngine` protocol, so the trainer never knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Sequence
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

    token_ids: the generated tokens, the stop token included when it is EOS / a stop token id.
    logprobs: one float per token in token_ids (see SamplingParams for which distribution).
    finish_reason: "stop" (EOS, stop token or stop string) or "length" (max_tokens reached).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator.

    generate: for each prompt (a list of token ids), `params.n` completions, in prompt order; result[i][j]
    is the j-th completion of prompt i. Per-request seeds: completion j of prompt i uses
    `params.seed + i * params.n + j` when a seed is given, so results do not depend on batching.
    sync_weights: called after every optimizer step. An engine that reads the policy's parameters in place
    does nothing; one that keeps fused copies refreshes them here.
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]: ...

    def sync_weights(self) -> None: ...


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

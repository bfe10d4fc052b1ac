"""One sequence being generated: its tokens, KV block table, sampling state and stop checks.

A prompt with `n` samples enters the scheduler as one `PrefillUnit` of n sequences that share the same
tokens; only the first (the leader) is prefilled, the others fork its KV blocks. A preempted sequence comes
back as a unit of one and is recomputed from scratch (prompt + tokens generated so far).

Multi-turn: a sequence that ends a turn (EOS / stop) in `generate_turns` is PAUSED with its KV blocks kept;
`extend_context` appends the next turn's context tokens (tool results, the next assistant header), and the
sequence comes back as a unit of one whose `num_cached` leading tokens are already in its blocks, so only
the new tokens are prefilled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cohort.types import FinishReason, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # a turn ended; the blocks are kept until the conversation continues or ends
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A single completion in flight.

    token_ids: prompt followed by the generated tokens. The KV of every token but the last is cached
    while the sequence is running (the last one is fed to the next decode step).
    seed: per-request seed; the sampler derives token t's noise from (seed, t), so a sequence samples the
    same tokens whatever the batch it lands in and across preemption.
    logprobs, mask: one entry per completion token; mask 1 for sampled tokens, 0 for context tokens appended
    between turns (whose logprob is recorded as 0.0).
    num_cached: leading tokens whose KV is already in the blocks when the sequence is next prefilled (a
    continued turn); 0 for a fresh or recomputed sequence.
    turn_start: index in token_ids of the current turn's first sampled token.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    request_index: tuple[int, int]  # (prompt index, sample index) for the result layout
    stop_ids: frozenset[int]
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    mask: list[int] = field(default_factory=list)
    multi_turn: bool = False
    num_cached: int = 0
    turns: int = 1
    turn_start: int = -1
    # a prompt with model inputs besides its ids (cohort.types.PromptWithInputs, e.g. images): the registered
    # family's prefill consumes them; rope_delta shifts the RoPE position of every later token (Qwen2-VL: max
    # prompt position + 1 - prompt length)
    inputs: object = None
    rope_delta: int = 0
    # this sample's completion cap: params.max_tokens, unless the request gave each sample its own
    # (CohortEngine.generate's max_tokens_each); 0 here means "from params"
    max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.turn_start < 0:
            self.turn_start = self.num_prompt_tokens
        if self.max_tokens <= 0:
            self.max_tokens = self.params.max_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def append(self, token: int, logprob: float, tokenizer=None) -> bool:
        """Record a sampled token; returns True when the sequence is finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.mask.append(1)
        if token in self.stop_ids or (self.params.stop_strings and tokenizer is not None and self._hit_stop_string(tokenizer)):
            self.finish_reason = "stop"
        elif self.num_completion_tokens >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def extend_sampled(self, tokens: list[int], logprobs: list[float], tokenizer=None) -> bool:
        """Record the tokens of a multi-step decode chunk up to the first that finishes the sequence (the
        rest were computed past a stop and are dropped); returns True when the sequence is finished."""
        if self.params.stop_strings and tokenizer is not None:
            # any() stops at the first token that finishes the sequence: the rest are never appended
            return any(self.append(token, logprob, tokenizer) for token, logprob in zip(tokens, logprobs))
        take = min(len(tokens), self.max_tokens - self.num_completion_tokens)
        stop = self.stop_ids
        for i in range(take):
            if tokens[i] in stop:
                take = i + 1
                self.finish_reason = "stop"
                break
        self.token_ids.extend(tokens[:take])
        self.logprobs.extend(logprobs[:take])
        self.mask.extend([1] * take)
        if self.finish_reason is None and self.num_completion_tokens >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def decode_budget(self, steps: int) -> int:
        """Tokens a chunk of `steps` decode steps may sample for this sequence (its max_tokens caps it)."""
        return min(steps, self.max_tokens - self.num_completion_tokens)

    @property
    def turn_ids(self) -> list[int]:
        """The tokens sampled in the current (or just ended) turn."""
        return self.token_ids[self.turn_start :]

    def extend_context(self, tokens: list[int]) -> None:
        """Append context tokens (not sampled, masked out of the loss) and open the next turn."""
        self.token_ids.extend(tokens)
        self.logprobs.extend([0.0] * len(tokens))
        self.mask.extend([0] * len(tokens))
        self.finish_reason = None
        self.turns += 1
        self.turn_start = len(self.token_ids)

    def _hit_stop_string(self, tokenizer) -> bool:
        # Decode only a tail: a stop string that ends at this token spans at most its length in
        # characters, hence at most that many tokens (every token decodes to >= 1 character, or 0 for
        # specials, which is why the window is a bit wider).
        longest = max(len(s) for s in self.params.stop_strings)
        # Only this turn's tokens: a stop string never spans the context appended before the turn.
        tail = self.token_ids[max(self.turn_start, len(self.token_ids) - longest - 4) :]
        text = tokenizer.decode(tail, skip_special_tokens=False)
        last = tokenizer.decode(tail[:-1], skip_special_tokens=False) if len(tail) > 1 else ""
        # A stop string counts only if it appears in the text once this token is added.
        return any(s in text and s not in last for s in self.params.stop_strings)


@dataclass(eq=False)
class PrefillUnit:
    """Sequences that share identical tokens and are prefilled once (a fresh group, or one resumed seq).

    num_tokens: the tokens the prefill computes (a continued turn skips its `num_cached` leading ones)."""

    seqs: list[Sequence]

    @property
    def leader(self) -> Sequence:
        return self.seqs[0]

    @property
    def num_tokens(self) -> int:
        return len(self.seqs[0]) - self.seqs[0].num_cached

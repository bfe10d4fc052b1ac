"""One sequence being generated: its tokens, KV block table, sampling state and stop checks.

A prompt with `n` samples enters the scheduler as one `PrefillUnit` of n sequences that share the same
tokens; only the first (the leader) is prefilled, the others fork its KV blocks. A preempted sequence comes
back as a unit of one and is recomputed from scratch (prompt + tokens generated so far).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cohort.types import FinishReason, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A single completion in flight.

    token_ids: prompt followed by the generated tokens. The KV of every token but the last is cached
    while the sequence is running (the last one is fed to the next decode step).
    seed: per-request seed; the sampler derives token t's noise from (seed, t), so a sequence samples the
    same tokens whatever the batch it lands in and across preemption.
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
        if token in self.stop_ids or (self.params.stop_strings and tokenizer is not None and self._hit_stop_string(tokenizer)):
            self.finish_reason = "stop"
        elif self.num_completion_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _hit_stop_string(self, tokenizer) -> bool:
        # Decode only a tail: a stop string that ends at this token spans at most its length in
        # characters, hence at most that many tokens (every token decodes to >= 1 character, or 0 for
        # specials, which is why the window is a bit wider).
        longest = max(len(s) for s in self.params.stop_strings)
        tail = self.completion_ids[-(longest + 4) :]
        text = tokenizer.decode(tail, skip_special_tokens=False)
        last = tokenizer.decode(tail[:-1], skip_special_tokens=False) if len(tail) > 1 else ""
        # A stop string counts only if it appears in the text once this token is added.
        return any(s in text and s not in last for s in self.params.stop_strings)


@dataclass(eq=False)
class PrefillUnit:
    """Sequences that share identical tokens and are prefilled once (a fresh group, or one resumed seq)."""

    seqs: list[Sequence]

    @property
    def leader(self) -> Sequence:
        return self.seqs[0]

    @property
    def num_tokens(self) -> int:
        return len(self.seqs[0])

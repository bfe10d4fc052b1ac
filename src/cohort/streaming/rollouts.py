"""Streaming rollouts on the colocated engine (`train.async_rollouts`): steps take groups as they finish.

The synchronous step admits its P prompts, waits for the longest of their G x P sequences, then trains: with
long-tailed lengths most of the batch sits finished while a few sequences decode alone. Here the engine keeps up
to (k + 1) x P groups resident (k = train.max_staleness) and a step trains on the first P groups to finish
(cohort.streaming.pacing decides which, so that none is more than k versions stale); the unfinished ones stay in
the engine with their KV and continue, after the update, with the new weights (cohort.engine.streaming). After each
step the engine is refilled with new prompts up to (k + 1) x P groups.

A step's batch is still P whole groups of G completions (rows k * G .. k * G + G - 1 are one prompt's), laid out
in the order the prompts were admitted; scoring and advantages are the synchronous path's (`score`). The
completions carry, per token, the version that sampled it: the loss's sampler importance weights correct each
token with the sampling logprob of the weights that drew it.

Seeds: the c-th chunk of P prompts drawn (c = 0, 1, ...) samples with the seeds the synchronous run gives step
start_step + c + 1, so with k = 0 (one chunk per step, all of it trained) the run is the synchronous one exactly.

Resume: prompts in flight when a checkpoint is written are not in it; a resumed run continues from the data
position after the last prompt drawn (with k = 0 nothing is in flight at a step's end: it resumes exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cohort.data import PromptBatch
from cohort.engine.streaming import EngineStream, StreamGroup
from cohort.streaming.pacing import Pacer
from cohort.types import Completion, RolloutBatch, SamplingParams


class Finished:
    """A `RolloutEngine` whose `generate` returns groups already sampled (the streamed ones), so the synchronous
    scoring path (cohort.rollout.collect_rollouts) scores them unchanged."""

    def __init__(self, groups: list[list[Completion]]) -> None:
        self.groups = groups

    def generate(self, prompts, params) -> list[list[Completion]]:
        if len(prompts) != len(self.groups) or any(len(g) != params.n for g in self.groups):
            raise RuntimeError(f"streamed rollouts: {len(prompts)} prompts x {params.n} completions asked for, "
                               f"{len(self.groups)} groups made (only a step's own groups can be scored)")
        return self.groups

    def sync_weights(self) -> None:
        pass


# score(step, engine, next_prompts): the synchronous rollout path of the trainer over `engine` and those prompts
Score = Callable[[int, Finished, Callable[[int], PromptBatch]], RolloutBatch]


class StreamingRollouts:
    """The trainer's rollout source with train.async_rollouts (`get(step)`, as cohort.remote.pipeline's).

    draw(count): the next `count` prompts of this rank; params_of(step): the synchronous run's sampling parameters
    of `step` (its seed); caps(chunk, row): per-sample completion caps, or None (benchmarks: fixed lengths)."""

    def __init__(self, engine, draw: Callable[[int], PromptBatch], params_of: Callable[[int], SamplingParams],
                 score: Score, sampler, *, prompts_per_step: int, max_staleness: int, start_step: int,
                 max_steps: int, caps: Callable[[int, int], Sequence[int] | None] | None = None) -> None:
        self.stream = EngineStream(engine, version=start_step)
        self.pacer = Pacer(prompts_per_step, max_staleness)
        self.draw, self.params_of, self.score, self.sampler, self.caps = draw, params_of, score, sampler, caps
        self.start_step, self.max_steps = start_step, max_steps
        self._buffer: list[tuple[int, PromptBatch, int]] = []  # drawn, not yet admitted: (chunk, batch, row)
        self._rows: dict[tuple[int, int], tuple[PromptBatch, int]] = {}  # admitted, by key (chunk, row)
        self._chunks = 0

    @property
    def version(self) -> int:
        """The version the current step trains from (training steps done so far)."""
        return self.stream.version

    def get(self, step: int) -> RolloutBatch:
        """The rollouts step `step` trains on: P finished groups, once pacing allows a step."""
        stream = self.stream
        stream.version = step - 1  # the weights now hold the updates of steps 1 .. step - 1
        admitted = self._admit(step)
        steps_before, chosen, waited = stream.steps, None, False
        seen = -1

        def ready() -> bool:
            nonlocal chosen, seen, waited
            if stream.finished_count != seen:  # selection changes only when a group finishes
                seen = stream.finished_count
                chosen = self.pacer.select(stream.groups, stream.version)
                waited = waited or (chosen is None and self.pacer.forced(stream.groups, stream.version))
            return chosen is not None

        stream.run(ready)
        if not ready():
            raise RuntimeError(f"step {step}: the engine ran out of work with {len(stream.groups)} groups resident "
                               "and no step ready (a sequence left the engine unfinished)")
        assert chosen is not None
        groups: list[StreamGroup] = sorted(chosen, key=lambda g: g.key)  # type: ignore[arg-type,return-value]  # admission order: the synchronous layout
        completions = stream.take(groups)
        rows = PromptBatch(*_columns([self._rows.pop(g.key) for g in groups]))  # type: ignore[call-overload]
        rollouts = self.score(step, Finished(completions), lambda count: rows)
        rollouts.metrics.update({"async/in_flight": float(len(stream.groups)), "async/admitted": float(admitted),
                                 "async/engine_steps": float(stream.steps - steps_before),
                                 "async/paced": float(waited)})
        return rollouts

    def _admit(self, step: int) -> int:
        """Fill the engine up to (k + 1) x P resident groups, never past what the remaining steps train on."""
        resident = len(self.stream.groups)
        wanted = (self.max_steps - step + 1) * self.pacer.per_step - resident
        count = min(self.pacer.room(resident), max(wanted, 0))
        for _ in range(count):
            if not self._buffer:
                batch = self.draw(self.pacer.per_step)
                self._buffer = [(self._chunks, batch, i) for i in range(len(batch.prompts))]
                self._chunks += 1
            chunk, batch, row = self._buffer.pop(0)
            assert batch.prompt_ids is not None  # the trainer's data is encoded
            params = self.params_of(self.start_step + chunk + 1)
            self._rows[(chunk, row)] = (batch, row)
            self.stream.admit(batch.prompt_ids[row], params, key=(chunk, row), index=row,
                              caps=self.caps(chunk, row) if self.caps is not None else None)
        return count

    def checkpoint_sampler(self, step: int):
        """The data position a checkpoint after `step` saves: after the last prompt drawn (see the docstring)."""
        return self.sampler

    def close(self) -> None:
        self.stream.abort()


def _columns(rows: list[tuple[PromptBatch, int]]) -> tuple[list[Any], list[list[int]], dict[str, list[Any]], list[int]]:
    """PromptBatch fields of rows taken from several drawn batches."""
    columns = {name: [b.columns[name][i] for b, i in rows] for name in (rows[0][0].columns if rows else {})}
    return ([b.prompts[i] for b, i in rows], [b.prompt_ids[i] for b, i in rows],  # type: ignore[index]
            columns, [b.indices[i] for b, i in rows])

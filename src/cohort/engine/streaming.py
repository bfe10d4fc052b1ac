"""Generation that outlives one call: groups admitted at any time, sequences resident across weight updates.

`CohortEngine.generate` adds its prompts, steps until every sequence is done and returns. `EngineStream` keeps
the same engine's sequences resident between calls instead, for asynchronous rollouts (cohort.streaming):

    stream = EngineStream(engine)
    stream.admit(prompt_ids, params)                # any time, also while other groups decode
    done = stream.run(lambda: len(finished) >= 4)   # steps the engine; groups come back as they finish
    ...optimizer step (the weights change in place)...
    stream.version += 1                             # the tokens sampled from now on carry the new version
    done = stream.run(...)                          # the unfinished sequences continue with the new weights

In-flight weight updates (partial rollouts). A sequence still decoding when the weights change keeps its KV
blocks and continues with the new weights: its earlier tokens keep the version and the sampling logprobs of the
weights that sampled them, and the KV of those tokens stays as the old weights computed it (PipelineRL and AReaL
do the same: recomputing it would cost a prefill of everything generated so far at every update). Exactly: the
KV of the prompt and of every token but the last is the old weights'; the last sampled token is fed to the next
decode step, so its KV and everything after it are the new weights'. A sequence preempted for lack of blocks is
recomputed from its tokens with the weights current then (its tokens and their versions do not change).

Versions: every completion token records `version` as it was when the forward that sampled it was queued. A
multi-step decode launch (EngineConfig.decode_steps > 1) queued before a weight update is read after it; its
tokens still carry the old version (on a GPU its kernels run before the update's, in stream order). Tokens
appended by someone else stepping the engine between stream steps (an evaluation's `generate`, which runs the
resident sequences along with its own) get the version current at the stream's next step: the weights that
sampled them, provided the owner sets `version` before that step and updates nothing in between.
Single-turn only (no generate_turns); the engine must not be used through `generate` while a stream holds
sequences.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from cohort.engine.engine import CohortEngine
from cohort.engine.sequence import Sequence, Status
from cohort.types import Completion, SamplingParams


@dataclass(eq=False)
class StreamGroup:
    """One admitted prompt's `params.n` sequences. `key`: the caller's label; `admitted`: the version current at
    admission (no token of the group is older); `finished_at`: the order groups finished in (None while any runs)."""

    key: object
    seqs: list[Sequence]
    admitted: int
    versions: list[list[int]] = field(default_factory=list)
    finished_at: int | None = None

    @property
    def done(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)


class EngineStream:
    def __init__(self, engine: CohortEngine, version: int = 0) -> None:
        self.engine = engine
        self.version = version  # the owner sets it after each weight update
        self.groups: list[StreamGroup] = []  # admitted, not yet taken (finished or not)
        # the engine's queued multi-step launch (read at the next step) and (its version, its rows' budgets)
        self._carry_launch: object = None
        self._carry: tuple[int, dict[int, int]] | None = None
        self._finished = 0
        self.steps = 0  # engine steps run (cumulative)

    # ---- admission ------------------------------------------------------------------------------------
    def admit(self, prompt: Seq[int], params: SamplingParams, *, key: object = None, index: int = 0,
              caps: Seq[int] | None = None) -> StreamGroup:
        """Queue `params.n` completions of `prompt`. Seeds as `generate` gives prompt `index` of a call:
        completion j uses `params.seed + index * params.n + j`. caps: one completion cap per sample (as
        generate's max_tokens_each)."""
        self.engine.runner.ensure_kv_cache()
        seqs = self.engine._add(index, prompt, params, caps=caps)
        group = StreamGroup(key=key, seqs=seqs, admitted=self.version, versions=[[] for _ in seqs])
        self.groups.append(group)
        return group

    @property
    def unfinished(self) -> list[StreamGroup]:
        return [g for g in self.groups if g.finished_at is None]

    def has_work(self) -> bool:
        return self.engine.scheduler.has_work()

    # ---- stepping -------------------------------------------------------------------------------------
    def step(self) -> list[StreamGroup]:
        """One engine step (none when nothing is queued or running); tags the tokens it appended with their version;
        the groups that finished in it (or, unseen so far, in someone else's steps)."""
        engine = self.engine
        if engine._inflight is not self._carry_launch:  # someone else stepped the engine (an evaluation's generate)
            self._tag()
        if self.has_work():
            try:
                engine.step()
            except BaseException:
                self.abort()
                raise
            self.steps += 1
            self._tag()
            # a launch queued in this step (chained or fresh) runs with the weights of now; read at a later step
            launch = engine._inflight
            self._carry_launch = launch
            self._carry = None if launch is None else (self.version, dict(zip(map(id, launch.seqs), launch.budgets)))
        done = []
        for group in self.unfinished:
            if group.done:
                group.finished_at = self._finished
                self._finished += 1
                done.append(group)
        return done

    def _tag(self) -> None:
        """Give every untagged completion token its version: the first ones of a row of the queued launch it came
        from get that launch's version (up to the row's budget), the others the current version."""
        version, budgets = self._carry if self._carry is not None else (self.version, {})
        for group in self.unfinished:
            for seq, versions in zip(group.seqs, group.versions):
                new = seq.num_completion_tokens - len(versions)
                if new:
                    old = min(new, budgets.get(id(seq), 0))
                    versions.extend([version] * old + [self.version] * (new - old))
        self._carry, self._carry_launch = None, None

    @property
    def finished_count(self) -> int:
        """Groups finished so far (cumulative): a cheap way to notice that one did."""
        return self._finished

    def run(self, until: Callable[[], bool]) -> list[StreamGroup]:
        """Step while `until()` is False and there is work; the groups that finished meanwhile, in order."""
        done: list[StreamGroup] = []
        device = self.engine.device
        # the device context matters with one engine per rank: Triton and graph capture use the current one
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            while not until():
                idle = not self.has_work()
                done += self.step()  # idle: only notices what finished in someone else's steps
                if idle:
                    break
        return done

    def take(self, groups: Seq[StreamGroup]) -> list[list[Completion]]:
        """The completions of finished `groups` (removed from the stream): per token, the version that sampled it
        (`Completion.token_versions`) and the oldest of them (`Completion.version`)."""
        out = []
        taken = set(map(id, groups))
        for group in groups:
            if group.finished_at is None:
                raise ValueError("take() of a group that is still decoding")
            out.append([Completion(s.completion_ids, s.logprobs, s.finish_reason or "length",
                                   version=min(v, default=group.admitted), token_versions=v,
                                   routed_experts=self.engine.runner.routes.result(s))
                        for s, v in zip(group.seqs, group.versions)])
        self.groups = [g for g in self.groups if id(g) not in taken]
        return out

    def abort(self) -> None:
        """Drop every resident sequence (after an error, or when the run ends)."""
        self.engine._abort()
        self.groups.clear()
        self._carry, self._carry_launch = None, None

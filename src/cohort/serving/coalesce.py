"""Concurrent generation requests merged into one engine batch (the server's trainer ranks, OpenAI clients).

Without this, requests that arrive together (the ranks of a data-parallel trainer each sending their share of
a step) run one after another on a replica, each in a smaller batch than the engine could decode at once.
`Coalescer.run(prompts, params)` queues the request; the first caller to find no batch running becomes the
leader, waits `window_s` for others to arrive, then runs everything queued as ONE `generate` call (one
SamplingParams per prompt) and hands each caller its own completions. Requests queued while a batch runs go
in the next one.

Draws do not change: completion j of a request's prompt i is sampled with seed + i * n + j, the request's own
numbering, wherever the prompt lands in the merged batch (its seed is shifted by its position), so a request
gets the same tokens merged or alone. Versions do not change either: each caller holds the server's read
lock while it waits, so no weight switch happens between its version read and its batch (engine_server.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

from cohort.types import Completion, SamplingParams

Generate = Callable[[list, list[SamplingParams]], "list[list[Completion]]"]


@dataclasses.dataclass
class _Request:
    prompts: list
    params: list[SamplingParams]
    wake: threading.Event = dataclasses.field(default_factory=threading.Event)
    lead: bool = False  # set with `wake`: run the next batch (the previous leader's own request is answered)
    finished: bool = False
    result: list[list[Completion]] | None = None
    error: BaseException | None = None


class Coalescer:
    def __init__(self, generate: Generate, window_s: float = 0.005) -> None:
        self.generate = generate
        self.window_s = window_s
        self.batches = 0  # generate calls made (merged batches), for tests and logs
        self._queue: list[_Request] = []
        self._cond = threading.Condition()
        self._running = False

    def run(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]) -> list[list[Completion]]:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        request = _Request(list(prompts), per_prompt)
        with self._cond:
            self._queue.append(request)
            if not self._running:
                self._running = True
                request.lead = True
                request.wake.set()
        while True:
            request.wake.wait()
            request.wake.clear()
            if request.lead:
                request.lead = False
                self._lead_one_batch()
            if request.finished:
                break
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _lead_one_batch(self) -> None:
        """Run what is queued as one batch, then pass the lead to a request still queued (each caller answers
        as soon as its own batch is done) or end the run."""
        if self.window_s > 0:
            time.sleep(self.window_s)  # let the other ranks' requests of this step arrive
        with self._cond:
            batch, self._queue = self._queue, []
        self._run_batch(batch)
        with self._cond:
            if self._queue:
                self._queue[0].lead = True
                self._queue[0].wake.set()
            else:
                self._running = False

    def _run_batch(self, batch: list[_Request]) -> None:
        prompts: list = []
        params: list[SamplingParams] = []
        for request in batch:
            for i, (prompt, p) in enumerate(zip(request.prompts, request.params, strict=True)):
                m = len(prompts)  # the prompt's index in the merged batch: draw as at index i of its request
                prompts.append(prompt)
                params.append(p if p.seed is None else dataclasses.replace(p, seed=p.seed + (i - m) * p.n))
        try:
            self.batches += 1
            groups = self.generate(prompts, params)
            start = 0
            for request in batch:
                request.result = groups[start:start + len(request.prompts)]
                start += len(request.prompts)
        except BaseException as exc:  # every caller of the batch gets the error
            for request in batch:
                request.error = exc
        for request in batch:
            request.finished = True
            request.wake.set()

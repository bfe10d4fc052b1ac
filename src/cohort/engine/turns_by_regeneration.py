"""Multi-turn rollouts for engines that cannot pause a sequence: each turn is a fresh `generate` call on the
conversation so far (prompt, model turns, tool results).

`CohortEngine.generate_turns` keeps a sequence and its KV cache alive across tool calls. Hugging Face
`generate` and a served engine (`cohort serve`, over HTTP) cannot, so they follow the same contract here: the
first turn of every completion is one `generate` call (the engine's own batching and seeds); then, for each
conversation whose turn ended on a stop and whose callback answered with context tokens, the next turn is
generated on prompt + everything so far, with n=1, the room left under max_tokens, and the seed
seed + row + 7919 x turn: one call per conversation, or with `batched` one call per round for engines that
take one SamplingParams per prompt (the same draws). Model tokens get mask 1 and their logprobs; context tokens mask 0 and logprob 0.
Images (a VLM's prompt, or a tool that returned one: the callback's ids then carry them, cohort.vision.conversation)
go with the conversation: the next turn's prompt is the ids joined by the last image carrier's `join_inputs`,
which knows every image of the conversation in order.
A served engine's completions carry the policy version that sampled them: a multi-turn completion records
the oldest of its turns' versions (the staleness that counts for the importance correction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from cohort.types import Completion, SamplingParams, TurnCallback, TurnEnd

Generate = Callable[..., "list[list[Completion]]"]  # generate(prompts, params or one params per prompt)


def generate_turns_by_regeneration(generate: Generate, prompts: Sequence[Sequence[int]], params: SamplingParams,
                                   on_turn_end: TurnCallback, *, batched: bool = False) -> list[list[Completion]]:
    """CohortEngine.generate_turns' contract over a plain `generate` (see the module docstring).

    batched: `generate` takes one SamplingParams per prompt (cohort's engine, a served one), so every
    conversation of a round goes in one call; each gets the seed its own call would have had (the engine
    draws completion j of prompt i with seed + i * n + j, so prompt i's seed is set i lower), and the draws
    equal the unbatched loop's."""
    groups = generate(prompts, params)
    convs = [_Conversation(i, j, p, c) for i, (p, group) in enumerate(zip(prompts, groups, strict=True))
             for j, c in enumerate(group)]
    live = [c for c in convs if c.finish_reason == "stop"]
    while live:
        pending = [on_turn_end(c.turn_end()) for c in live]
        replies: list[list[int] | None] = [r.result() if isinstance(r, Future) else r for r in pending]
        round_: list[tuple[_Conversation, SamplingParams]] = []
        for conv, tokens in zip(live, replies, strict=True):
            if not tokens:
                continue
            room = params.max_tokens - len(conv.ids)
            if len(tokens) >= room:
                raise ValueError(f"a continuation of {len(tokens)} tokens leaves no room to generate: the "
                                 f"completion has {len(conv.ids)} of max_tokens={params.max_tokens}; end the "
                                 "conversation (return None) when the context does not fit.")
            seed = None if params.seed is None else params.seed + conv.row(params.n) + 7919 * conv.turns
            conv.add_context(tokens)
            round_.append((conv, dataclasses.replace(params, n=1, max_tokens=room - len(tokens), seed=seed)))
        if batched and round_:
            shifted = [p if p.seed is None else dataclasses.replace(p, seed=p.seed - i)
                       for i, (_, p) in enumerate(round_)]
            answers = generate([conv.so_far() for conv, _ in round_], shifted)
        else:
            answers = [generate([conv.so_far()], p)[0] for conv, p in round_]
        for (conv, _), group in zip(round_, answers, strict=True):
            conv.add_turn(group[0])
        live = [conv for conv, _ in round_ if conv.finish_reason == "stop"]
    return [[c.completion() for c in convs[i * params.n : (i + 1) * params.n]] for i in range(len(prompts))]


class _Conversation:
    """One multi-turn completion being built."""

    def __init__(self, index: int, sample: int, prompt: Sequence[int], first: Completion) -> None:
        self.index, self.sample, self.prompt = index, sample, list(prompt)
        # what carries images (the prompt, continuations), in order: the next turns' prompts carry them too
        self.carriers: list = [prompt] if getattr(prompt, "num_images", 0) else []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.versions: list[int] = []
        self.turns, self.turn_start = 0, 0
        self.add_turn(first)

    def row(self, n: int) -> int:
        return self.index * n + self.sample

    def add_turn(self, c: Completion) -> None:
        self.turn_start = len(self.ids)
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.mask += [1] * len(c.token_ids)
        self.finish_reason = c.finish_reason
        self.turns += 1
        if c.version is not None:
            self.versions.append(c.version)

    def so_far(self) -> list[int]:
        """The conversation so far as the next turn's prompt (with its images, when it has any)."""
        ids = self.prompt + self.ids
        return self.carriers[-1].join_inputs(ids, self.carriers) if self.carriers else ids

    def add_context(self, tokens: Sequence[int]) -> None:
        if getattr(tokens, "num_images", 0):
            self.carriers.append(tokens)
        self.ids += list(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.mask += [0] * len(tokens)

    def turn_end(self) -> TurnEnd:
        return TurnEnd(prompt_index=self.index, sample_index=self.sample, prompt_ids=list(self.prompt),
                       completion_ids=list(self.ids), turn_ids=self.ids[self.turn_start :], turn=self.turns,
                       finish_reason=self.finish_reason)

    def completion(self) -> Completion:
        return Completion(self.ids, self.logprobs, self.finish_reason, mask=self.mask, turns=self.turns,
                          version=min(self.versions) if self.versions else None)

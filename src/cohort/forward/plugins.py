"""Forwards for prompts the plain packed row cannot hold, registered by the layer that makes such prompts.

A prompt with model inputs besides its token ids (`cohort.types.PromptWithInputs`: images) needs its own
training forward (the vision plug-in embeds image features into the row). The packed forward asks
`row_forward_for(sequences)`; the plug-in calls `register_row_forward` when it is imported. This layer never
imports the plug-in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from cohort.types import PromptWithInputs

# (prompt, completion) pairs -> PackedLogprobs; keyword arguments as packed_forward_logprobs takes them
RowForward = Callable[..., Any]
_ROW_FORWARDS: list[RowForward] = []


def register_row_forward(forward: RowForward) -> None:
    """The forward for sequences whose prompts carry inputs besides their ids (idempotent)."""
    if forward not in _ROW_FORWARDS:
        _ROW_FORWARDS.append(forward)


def has_extra_inputs(prompts: Sequence[Any]) -> bool:
    return any(isinstance(prompt, PromptWithInputs) for prompt in prompts)


def row_forward_for(sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> RowForward | None:
    """None for plain token-id prompts (the packed row); the registered forward for prompts with inputs."""
    if not has_extra_inputs([prompt for prompt, _ in sequences]):
        return None
    if not _ROW_FORWARDS:
        raise ValueError("prompts carry inputs besides their token ids (images) but no forward for them is "
                         "registered: import cohort.vision (cohort.setup does) before training on them")
    return _ROW_FORWARDS[-1]

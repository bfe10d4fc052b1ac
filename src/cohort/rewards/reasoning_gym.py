"""The reasoning-gym verifier as a reward function: `reasoning_gym_score`.

Rows made by `load_prompt_dataset("reasoning_gym:<task>", ...)` carry `answer` and `metadata` (with
`source_dataset`); the task's own `score_answer(answer, entry)` grades the answer extracted from the
completion. Scores are in [0, 1]; some tasks give partial credit.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any, Literal

from cohort.rewards.builtins import ANSWER_TAG, last_number
from cohort.rewards.protocol import completion_text

Extract = Literal["auto", "answer_tag", "last_line", "last_number"]
_NUMERIC = re.compile(r"^\s*-?\d[\d,]*(?:\.\d+)?\s*$")


@cache
def _scorer(task: str):
    import reasoning_gym  # optional dependency (the data extra: reasoning-gym tasks)

    # The scorer of a default-configured instance: score_answer reads the entry's answer and metadata,
    # not the generator's settings.
    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(text: str, gold: str, mode: Extract = "auto") -> str | None:
    """The answer a completion gives. auto: the last `<answer>` tag if any, else the last number when the
    gold answer is a number, else the last non-empty line.

    >>> extract_answer("4 - 1 = 3\\nSo the answer is 3.", "3")
    '3'
    >>> extract_answer("thinking <answer> blue </answer>", "red")
    'blue'
    >>> extract_answer("hmm\\nred\\n", "red")
    'red'
    """
    if mode in ("auto", "answer_tag"):
        tags = ANSWER_TAG.findall(text)
        if tags:
            return tags[-1].strip()
        if mode == "answer_tag":
            return None
    if mode == "last_number" or (mode == "auto" and _NUMERIC.match(gold)):
        value = last_number(text)
        if value is None:
            return None
        return str(int(value)) if value.is_integer() else str(value)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else None


def reasoning_gym_score(
    completions: list[Any],
    answer: list[Any],
    metadata: list[Any],
    prompts: list[Any] | None = None,
    extract: Extract = "auto",
    **kwargs: Any,
) -> list[float | None]:
    """The task's own `score_answer` on the extracted answer; None for rows without reasoning-gym metadata.

    >>> meta = {"source_dataset": "chain_sum", "source_index": 0, "num_terms": 2, "num_digits": 1, "expression": "4 - 1"}
    >>> reasoning_gym_score(["4 - 1 = 3", "<answer>5</answer>", "x"], ["3", "3", "3"], [meta, meta, None])
    [1.0, 0.0, None]
    """
    out: list[float | None] = []
    for j, (c, gold, meta) in enumerate(zip(completions, answer, metadata, strict=True)):
        if isinstance(meta, str):  # metadata saved to a jsonl/csv file as a JSON string
            meta = json.loads(meta)
        if not isinstance(meta, dict) or "source_dataset" not in meta:
            out.append(None)
            continue
        entry = {"question": prompts[j] if prompts else "", "answer": str(gold), "metadata": meta}
        given = extract_answer(completion_text(c), str(gold), extract)
        out.append(float(_scorer(meta["source_dataset"])(given, entry)))
    return out

"""Built-in reward functions: math accuracy, formats, numeric answers, length shaping.

Plain functions (or small callable classes for the configurable ones) following the reward contract in
`cohort.rewards.protocol`; each docstring has a hand-checked example run as a doctest. Completions may be
text or conversational message lists.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from cohort.rewards.protocol import completion_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _gold(solution: Sequence[Any] | None, answer: Sequence[Any] | None, n: int, fn: str) -> list[str]:
    gold = solution if solution is not None else answer
    if gold is None:
        raise ValueError(f"{fn} needs a 'solution' or 'answer' column with the gold answer of each prompt.")
    if len(gold) != n:
        raise ValueError(f"{fn}: {len(gold)} gold answers for {n} completions.")
    # GSM8K-style gold: the final answer follows '#### ' after the worked solution.
    return [str(g).rsplit("####", 1)[-1].strip() if "####" in str(g) else str(g) for g in gold]


# -- math accuracy ----------------------------------------------------------------------------------
def _math_verify_timeouts() -> tuple[int | None, int | None]:
    # math-verify times out with signal.alarm, which only works in the main thread.
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return None, None


def math_correct(content: str, gold: str) -> bool | None:
    """Whether `content` states the same mathematical answer as `gold` (math-verify); None if gold is unparsable."""
    # optional dependency (the data extra: math answers)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    parse_timeout, verify_timeout = _math_verify_timeouts()
    gold_parsed = parse(gold, parsing_timeout=parse_timeout)
    if not gold_parsed:
        return None
    tagged = ANSWER_TAG.findall(content)
    if tagged:  # an explicit <answer> wins over numbers in the reasoning
        content = tagged[-1]
    answer = parse(
        content,
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=parse_timeout,
    )
    return bool(verify(gold_parsed, answer, timeout_seconds=verify_timeout))


def accuracy(
    completions: list[Any], solution: list[Any] | None = None, answer: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    r"""1.0 when the completion's answer equals the gold answer (math-verify), 0.0 otherwise, None when the
    gold answer (column `solution`, else `answer`; GSM8K's text after `####`) cannot be parsed.

    >>> accuracy([r"so it is \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "x"], solution=[r"\frac{1}{3}", "1/3", "?"])
    [1.0, 0.0, None]
    """
    gold = _gold(solution, answer, len(completions), "accuracy")
    out: list[float | None] = []
    for c, g in zip(completions, gold, strict=True):
        ok = math_correct(completion_text(c), g)
        out.append(None if ok is None else float(ok))
    return out


# -- formats ----------------------------------------------------------------------------------------
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)
_THINK_ANSWER = re.compile(r"^\s*<think>(?!.*<think>).*?</think>\s*<answer>(?!.*<answer>).*?</answer>\s*$", re.DOTALL)
_ANSWER_ONLY = re.compile(r"^(?!.*<answer>.*<answer>).*<answer>.+?</answer>\s*$", re.DOTALL)


def think_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion starts with one `<think>...</think>` block (TRL's think_format_reward).

    >>> think_format(["<think>\\nreason\\n</think>\\n42", "<think>reason, no end", "42 <think>x</think>"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _THINK.match(completion_text(c)) else 0.0 for c in completions]


def think_answer_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for exactly `<think>...</think> <answer>...</answer>` (whitespace allowed between and around).

    >>> think_answer_format(["<think>a</think>\\n<answer>4</answer>", "<think>a</think> 4", "<answer>4</answer>"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _THINK_ANSWER.match(completion_text(c)) else 0.0 for c in completions]


def answer_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion ends with one non-empty `<answer>...</answer>` (reasoning may come before).

    >>> answer_format(["12 + 30 = 42 <answer>42</answer>", "<answer></answer>", "<answer>1</answer> more"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _ANSWER_ONLY.match(completion_text(c)) else 0.0 for c in completions]


# -- numeric answers --------------------------------------------------------------------------------
def last_number(text: str) -> float | None:
    """The last number in `text` (commas as thousands separators allowed), or None.

    >>> last_number("She has 1,200 apples and gives away 3.5, leaving -7")
    -7.0
    """
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def extract_numeric_answer(text: str) -> float | None:
    """The answer a completion commits to: the last `<answer>` tag, else the last `\\boxed{}`, else the last
    number of the text; None when there is no number.

    >>> extract_numeric_answer("3 + 4 = 7, so <answer>7</answer>. Check: 8")
    7.0
    """
    for pattern in (ANSWER_TAG, _BOXED):
        found = pattern.findall(text)
        if found and (value := last_number(found[-1])) is not None:
            return value
    return last_number(text)


def answer_number(
    completions: list[Any], answer: list[Any] | None = None, solution: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's final number equals the gold number (column `answer`, else `solution`;
    GSM8K's `#### 42` understood), 0.0 otherwise, None when the gold has no number.

    >>> answer_number(["so 42.", "<answer>41</answer> (not 42)", "1,000 apples", "7"], answer=["#### 42", "41", "1000", "n/a"])
    [1.0, 1.0, 1.0, None]
    """
    gold = _gold(solution if answer is None else None, answer, len(completions), "answer_number")
    out: list[float | None] = []
    for c, g in zip(completions, gold, strict=True):
        want = last_number(g)
        if want is None:
            out.append(None)
            continue
        got = extract_numeric_answer(completion_text(c))
        out.append(float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)))
    return out


def number_line_format(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion's last non-empty line is a bare number (an optional "Answer:" label and
    trailing period allowed): the output format the numeric tasks ask for, checkable without the gold.

    >>> number_line_format(["7 + 5 = 12\\n12", "The answer is 12.", "Answer: -3.5.", ""])
    [1.0, 0.0, 1.0, 0.0]
    """
    out = []
    for c in completions:
        lines = [line.strip() for line in completion_text(c).strip().splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        out.append(1.0 if _NUMBER_LINE.fullmatch(last) else 0.0)
    return out


_NUMBER_LINE = re.compile(r"(?:(?:final )?answer\s*[:=]\s*)?-?\d[\d,]*(?:\.\d+)?\.?", re.IGNORECASE)


# -- length shaping ---------------------------------------------------------------------------------
class soft_overlong_punishment:  # lower-case: used like a function, soft_overlong_punishment(512, 128)
    """DAPO's soft overlong punishment (Eq. 13): 0 up to L_max - L_cache tokens, then a linear ramp down to
    -1 at L_max, and -1 beyond.

    >>> f = soft_overlong_punishment(max_completion_length=100, soft_cache_length=20)
    >>> f(completion_ids=[[1] * 80, [1] * 90, [1] * 100, [1] * 101])
    [0.0, -0.5, -1.0, -1.0]
    """

    __name__ = "soft_overlong_punishment"

    def __init__(self, max_completion_length: int, soft_cache_length: int):
        if not 0 < soft_cache_length <= max_completion_length:
            raise ValueError(
                f"soft_cache_length={soft_cache_length} must be in (0, max_completion_length={max_completion_length}]."
            )
        self.max_len, self.cache = max_completion_length, soft_cache_length

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        start = self.max_len - self.cache
        return [max(-1.0, min(0.0, (start - len(ids)) / self.cache)) for ids in completion_ids]


class cosine_scaled_length:  # lower-case: configured like a function, as in Open-R1
    """Open-R1's cosine-scaled reward ("Demystifying Long CoT", App. C.1): correctness scaled by length.

    With t = min(len(ids) / max_len, 1) and r = lo + (hi - lo) * (1 + cos(pi t)) / 2: a correct completion
    goes from max_value_correct (empty) to min_value_correct (max_len), so shorter is better; a wrong one
    from min_value_wrong (empty) to max_value_wrong (max_len), so a short wrong answer costs most. None
    where the correctness check gives None. `correct` is any function (completion_text, gold) -> bool | None;
    by default math-verify.

    >>> f = cosine_scaled_length(max_len=100)
    >>> f(completions=["4", "5", "4"], completion_ids=[[0] * 50, [0] * 50, [0] * 100], solution=["4", "4", "4"])
    [0.75, -0.75, 0.5]
    """

    __name__ = "cosine_scaled_length"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
        correct: Callable[[str, str], bool | None] = math_correct,
    ):
        self.max_len = max_len
        self.wrong = (min_value_wrong, max_value_wrong)
        self.right = (max_value_correct, min_value_correct)
        self.correct = correct

    def __call__(
        self,
        completions: list[Any],
        completion_ids: list[list[int]],
        solution: list[Any] | None = None,
        answer: list[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        gold = _gold(solution, answer, len(completions), "cosine_scaled_length")
        out: list[float | None] = []
        for c, ids, g in zip(completions, completion_ids, gold, strict=True):
            ok = self.correct(completion_text(c), g)
            if ok is None:
                out.append(None)
                continue
            start, end = self.right if ok else self.wrong  # values at length 0 and at max_len
            progress = min(len(ids) / self.max_len, 1.0)
            out.append(end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress)))
        return out

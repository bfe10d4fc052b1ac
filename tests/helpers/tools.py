"""Small tools the agent tests call: a quick one (add) and one that sleeps past a timeout (hang)."""

from __future__ import annotations

import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def hang(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "late"

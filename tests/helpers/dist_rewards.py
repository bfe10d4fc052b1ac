"""Reward functions that misbehave on one rank of a torchrun launch (tests/integration/test_distributed_failures.py).

The rank comes from torchrun's RANK variable; at other steps and ranks they score like `toy_task.digit_share`.
"""

from __future__ import annotations

import os
import random
import time

from tests.helpers.toy_task import digit_share


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def fails_on_rank1_at_step2(completions, digit, trainer_state, **kwargs):
    """Raises on rank 1 at step 2: a reward backend that goes down on one node."""
    if _rank() == 1 and trainer_state.global_step == 2:
        raise RuntimeError("reward backend unreachable from rank 1")
    return digit_share(completions, digit)


def stalls_on_rank1_at_step2(completions, digit, trainer_state, **kwargs):
    """Hangs (2 minutes) on rank 1 at step 2: a reward backend that stops answering; rank 0 waits for it
    in the reward gather, and its collective timeout must end the launch long before this returns."""
    if _rank() == 1 and trainer_state.global_step == 2:
        time.sleep(120)
    return digit_share(completions, digit)


def informative_on_rank0_only(completions, **kwargs):
    """Rank 0: distinct random rewards (every group informative); other ranks: all 0 (every group all-equal).
    With dynamic sampling, rank 0 is full after one try while rank 1 resamples until its last try."""
    if _rank() == 0:
        return [random.random() for _ in completions]
    return [0.0] * len(completions)

"""Start and end of test workers that run as gloo ranks in processes of their own (mp.spawn, forkserver).

gloo's C++ threads can abort the interpreter's own teardown after the group is destroyed ("terminate called
without an active exception", "double free or corruption": SIGABRT, about once in 20 runs on the 2-core CI
machine), which the launcher then reports as a failed rank although every result was written. A worker calls
`enter_rank()` first and `leave_rank()` last, after its `try/finally` destroyed the group: an exception
still propagates (`leave_rank` is not reached), a success leaves without the teardown.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import NoReturn


def enter_rank() -> None:
    """A native crash in this rank prints every thread's Python stack, so it names where it happened."""
    faulthandler.enable(all_threads=True)


def leave_rank() -> NoReturn:
    """End a rank whose results are on disk and whose process group is destroyed, skipping interpreter
    teardown (exit status 0)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def join_gloo(rank: int, world: int, init_file: str) -> None:
    """A spawned test worker's start: `enter_rank`, RANK / WORLD_SIZE for cohort.distributed, one CPU thread
    (the ranks share CI's 2 cores), and the gloo group through `init_file` when there is more than one rank."""
    import torch
    import torch.distributed as dist

    enter_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

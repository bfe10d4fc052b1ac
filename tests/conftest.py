"""Suite-wide fixtures."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """`train.sharding=fsdp` on one process makes a world-of-one process group that lives as long as the
    process (the sharded model needs it). In the test process, end it after the test that made it, so a later
    test never starts with an initialised group it did not ask for."""
    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

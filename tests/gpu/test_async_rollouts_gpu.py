"""Asynchronous rollouts on CUDA: a partial rollout straddling a weight update with the engine's GPU path (CUDA
graphs, the in-graph sampler, multi-step decode launches of 8 that chain across the update): versions split where
the queued launch ends, the first part equals the old weights alone, the second the new weights over the old KV
(tests/integration/test_async_rollouts.py has the CPU version and the reference)."""

from __future__ import annotations

import pytest
import torch
from tests.integration.engine_models import tiny_model
from tests.integration.test_async_rollouts import check_partial_rollout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("decode_steps", [None, 1])
def test_a_partial_rollout_straddling_an_update_on_cuda(decode_steps):
    model = tiny_model("llama").to("cuda")
    check_partial_rollout(model, decode_steps, total=40, atol=2e-4, exact_part1=False)

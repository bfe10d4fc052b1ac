"""`cohort serve` on a second GPU: weights pushed over NCCL from the trainer's GPU, greedy tokens equal to an
in-process engine on the same weights. Needs 2 GPUs (NCCL cannot join two processes on one device)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.serving import ServerProcess
from tests.helpers.toy_task import tiny_model, write_toy_workspace

from cohort.engine import CohortEngine
from cohort.model import load_policy
from cohort.serving import RemoteEngine
from cohort.setup import _eos_ids
from cohort.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def test_nccl_push_and_greedy_generation_match_the_in_process_engine(tmp_path):
    model_dir, _ = write_toy_workspace(tmp_path)
    _, tok = load_policy(str(model_dir), dtype=torch.bfloat16)
    policy = tiny_model(tok, seed=5).to(device="cuda:0", dtype=torch.bfloat16)
    server = ServerProcess(model_dir, device="cuda", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        remote = RemoteEngine(server.address, policy, bucket_bytes=64 << 10)
        assert remote.last_push["buckets"] > 1
        assert remote.client.request("GET", "/health", phase="test")["backend"] == "nccl"
        prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3?")]
        params = SamplingParams(n=2, max_tokens=16, temperature=0.0)
        local = CohortEngine(policy, tok, eos_token_ids=_eos_ids(tok, policy), kv_cache_fraction=0.05)
        expected = local.generate(prompts, params)
        served = remote.generate(prompts, params)
        assert [c.token_ids for g in served for c in g] == [c.token_ids for g in expected for c in g]
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1 * torch.randn_like(p))
        remote.sync_weights()
        local.sync_weights()
        served = remote.generate(prompts, params)
        assert [c.token_ids for g in served for c in g] == [c.token_ids for g in local.generate(prompts, params)
                                                            for c in g]
        assert {c.version for g in served for c in g} == {1}
    finally:
        server.kill()

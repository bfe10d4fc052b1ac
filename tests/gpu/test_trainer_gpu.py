"""The whole loop on CUDA with cohort's engine: it learns, and resume is exact (skips without CUDA)."""

from __future__ import annotations

import pytest
import torch
from tests.integration import test_trainer_resume as resume_case
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the toy task is reasoning-gym's chain_sum; the GPU machines lack it unless its wheels are carried (.gl/rg)
pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install --no-deps .gl/rg/*.whl")


def test_learns_on_cuda_with_the_engine(tmp_path):
    cfg = toy_config(tmp_path, steps=30)
    comp = toy_components(cfg)
    assert type(comp.engine).__name__ == "CohortEngine" and comp.device.type == "cuda"
    rewards = [m["reward"] for m in train(cfg, comp).history]
    assert sum(rewards[-5:]) / 5 > 3 * sum(rewards[:5]) / 5, rewards


@pytest.mark.parametrize("overrides", [[], resume_case.LOW_MEMORY, ["train.sharding=fsdp"]],
                         ids=["default", "low-memory", "fsdp-one-gpu"])
def test_resume_is_exact_on_cuda(tmp_path, overrides):
    resume_case.test_resume_equals_uninterrupted(tmp_path, overrides)


def test_host_offloaded_adamw_on_cuda_matches_adamw():
    from cohort.policy.optim import HostOffloadAdamW

    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 64).cuda().bfloat16()
    off = torch.nn.Linear(64, 64).cuda().bfloat16()
    off.load_state_dict(ref.state_dict())
    kw = {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.99), "fused": True}
    opt_ref = torch.optim.AdamW(ref.parameters(), **kw)
    opt_off = HostOffloadAdamW(off.parameters(), bucket_elements=64, **kw)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        for model, opt in ((ref, opt_ref), (off, opt_off)):
            opt.zero_grad()
            model(x).float().pow(2).sum().backward()
            opt.step()
    for a, b in zip(ref.parameters(), off.parameters()):
        assert torch.equal(a, b)
    assert all(st["exp_avg"].is_pinned() for st in opt_off.state.values())

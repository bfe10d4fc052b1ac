"""Optimiser: fp32 master weights keep updates that bf16 weights alone would lose; schedules by hand."""

from __future__ import annotations

import math

import torch

from cohort.policy.optim import MasterWeightAdamW, build_optimizer, build_scheduler


def test_master_weights_follow_fp32_adamw_and_keep_tiny_updates():
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 8, bias=False)
    low = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(low.weight.float())
    initial = low.weight.detach().float().clone()
    opt_low = build_optimizer(low, lr=1e-6, weight_decay=0.01, betas=(0.9, 0.999))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-6, weight_decay=0.01, betas=(0.9, 0.999))
    assert isinstance(opt_low, MasterWeightAdamW)
    for _ in range(5):
        g = torch.randn(8, 8)
        ref.weight.grad, low.weight.grad = g.clone(), g.to(torch.bfloat16)
        opt_ref.step()
        opt_low.step()
    # an lr of 1e-6 moves each weight by ~5e-6 in 5 steps: below bf16's resolution, kept by the fp32 master
    torch.testing.assert_close(opt_low.masters[0], ref.weight.detach(), rtol=0, atol=1e-6)
    assert (opt_low.masters[0] - initial).abs().mean() > 1e-6  # the master weights moved
    unchanged = (low.weight.detach().float() == initial).float().mean()
    assert unchanged > 0.5  # ...while most bf16 weights still read the same value
    assert torch.equal(low.weight, opt_low.masters[0].to(torch.bfloat16))


def test_master_state_round_trips():
    low = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt = build_optimizer(low, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    for p in low.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    fresh = torch.nn.Linear(4, 4).to(torch.bfloat16)
    opt2 = build_optimizer(fresh, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    opt2.load_state_dict(saved)
    for a, b in zip(opt.masters, opt2.masters):
        assert torch.equal(a, b)
    assert torch.equal(fresh.weight, low.weight)


def test_warmup_then_cosine_by_hand():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_scheduler(opt, kind="cosine", warmup_steps=2, total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # warmup: (0+1)/2, (1+1)/2; then 0.5 * (1 + cos(pi * k / 4)) for k = 0, 1, 2, 3
    expected = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(lrs, expected)), lrs


def test_no_master_weights_keeps_adam_state_in_the_weight_dtype():
    low = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    opt = build_optimizer(low, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), master_weights=False)
    assert type(opt) is torch.optim.AdamW
    before = low.weight.detach().clone()
    low.weight.grad = torch.ones_like(low.weight)
    opt.step()
    state = opt.state[low.weight]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    torch.testing.assert_close(low.weight.float(), before.float() - 1e-2, rtol=0, atol=4e-3)  # Adam's first step


def test_host_offloaded_adamw_equals_adamw_and_round_trips():
    """Moments on the host, stepped in buckets: the same trajectory as one AdamW, through a state-dict
    round trip in the middle (resume)."""
    from cohort.policy.optim import HostOffloadAdamW

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    off = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    off.load_state_dict(ref.state_dict())
    kw = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.99)}
    opt_ref = torch.optim.AdamW(ref.parameters(), **kw)
    opt_off = build_optimizer(off, **kw, master_weights=False, offload=True)
    assert isinstance(opt_off, HostOffloadAdamW)
    opt_off = HostOffloadAdamW(off.parameters(), bucket_elements=100, **kw)  # several buckets
    assert len(opt_off.inner) > 1
    sched = build_scheduler(opt_off, kind="cosine", warmup_steps=1, total_steps=6)
    sched_ref = build_scheduler(opt_ref, kind="cosine", warmup_steps=1, total_steps=6)
    x = torch.randn(5, 8)
    for step in range(6):
        for model, opt, s in ((ref, opt_ref, sched_ref), (off, opt_off, sched)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
            s.step()
        if step == 2:  # resume as the trainer does: fresh optimizer and scheduler, then both state dicts
            saved, sched_state = opt_off.state_dict(), sched.state_dict()
            opt_off = HostOffloadAdamW(off.parameters(), bucket_elements=100, **kw)
            sched = build_scheduler(opt_off, kind="cosine", warmup_steps=1, total_steps=6)
            opt_off.load_state_dict(saved)
            sched.load_state_dict(sched_state)
    for a, b in zip(ref.parameters(), off.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(st["exp_avg"].device.type == "cpu" for st in opt_off.state.values())


def test_offload_needs_bf16_moments():
    import pytest

    from cohort.config import CohortConfig, apply_overrides
    from cohort.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.master_weights=false"):
        apply_overrides(CohortConfig(), ["train.optimizer_offload=true"]).validate()
    apply_overrides(CohortConfig(), ["train.optimizer_offload=true", "train.master_weights=false"]).validate()

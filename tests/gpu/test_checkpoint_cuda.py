"""Checkpoints on CUDA: a bf16 model on the GPU reloads in place, CUDA generators round-trip."""

import pytest
import torch
from tests.helpers.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_llama(seed: int):
    return tiny_llama(seed).to("cuda", torch.bfloat16)


def test_bf16_cuda_round_trip_with_cuda_rng(tmp_path):
    from cohort.checkpointing import load_checkpoint, save_checkpoint

    model = _cuda_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(
        torch.tensor([[1, 2, 3]], device="cuda"), labels=torch.tensor([[1, 2, 3]], device="cuda")
    ).loss.backward()
    opt.step()
    torch.cuda.manual_seed_all(7)
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=opt, trainer_state={})
    expected = torch.rand(4, device="cuda").tolist()

    fresh = _cuda_llama(1)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    torch.cuda.manual_seed_all(123)
    load_checkpoint(path, model=fresh, optimizer=opt2)
    assert torch.rand(4, device="cuda").tolist() == expected
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert b.device.type == "cuda" and b.dtype == torch.bfloat16 and torch.equal(a, b)
    state = next(iter(opt2.state.values()))
    assert state["exp_avg"].device.type == "cuda"

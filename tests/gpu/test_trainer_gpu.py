"""The whole loop on CUDA with cohort's engine: it learns, and resume is exact (skips without CUDA)."""

from __future__ import annotations

import pytest
import torch
from tests.integration import test_trainer_resume as resume_case
from tests.integration.test_trainer_learns import toy_components, toy_config

from cohort.trainer import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_learns_on_cuda_with_the_engine(tmp_path):
    cfg = toy_config(tmp_path, steps=30)
    comp = toy_components(cfg)
    assert type(comp.engine).__name__ == "CohortEngine" and comp.device.type == "cuda"
    rewards = [m["reward"] for m in train(cfg, comp).history]
    assert sum(rewards[-5:]) / 5 > 3 * sum(rewards[:5]) / 5, rewards


def test_resume_is_exact_on_cuda(tmp_path):
    resume_case.test_resume_equals_uninterrupted(tmp_path)

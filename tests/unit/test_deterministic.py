"""train.deterministic switches torch's deterministic algorithms, cuDNN's deterministic mode and cuBLAS's fixed
workspace on, before the model loads; off, it changes nothing. (That two CUDA runs are then bitwise equal is
tests/gpu/test_deterministic_gpu.py.)"""

from __future__ import annotations

import os

import pytest
import torch

from cohort.run import seeding


@pytest.fixture
def restore(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]


def test_on_sets_every_switch(restore):
    seeding.set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_off_changes_nothing(restore):
    seeding.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_build_components_applies_the_setting(restore, tmp_path):
    from tests.integration.test_trainer_learns import toy_components, toy_config

    cfg = toy_config(tmp_path, steps=1)
    cfg.train.deterministic = True
    toy_components(cfg)
    assert torch.are_deterministic_algorithms_enabled()

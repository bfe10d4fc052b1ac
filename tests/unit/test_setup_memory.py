"""The engine's KV pool is sized after the trainer's needs: the memory check on a (simulated) GPU."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_models import tiny_llama

from cohort import setup
from cohort.config import CohortConfig
from cohort.errors import ConfigError

GIB = 2**30


def _run(monkeypatch, free_bytes: int) -> tuple[float, list[str]]:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    lines: list[str] = []
    cfg = CohortConfig()
    cfg.train.token_budget = 4096
    frac = setup._check_memory(cfg, tiny_llama(0), torch.device("cuda"), False, lines.append)
    return frac, lines


def test_plenty_of_memory_keeps_the_configured_fraction(monkeypatch):
    frac, lines = _run(monkeypatch, 40 * GIB)
    assert frac == CohortConfig().generation.kv_cache_fraction
    assert any(line.startswith("memory estimate") for line in lines)


def test_tight_memory_lowers_the_fraction(monkeypatch):
    from cohort.memory import estimate_memory

    need = estimate_memory(tiny_llama(0).config, dtype=torch.float32, token_budget=4096, chunk_tokens=4096,
                           fused_logprob_kernels=True).total
    free = int(need / 0.8)  # the update leaves about a tenth of free memory, less than the 0.3 asked for
    frac, lines = _run(monkeypatch, free)
    assert 0.02 < frac < 0.3 and any("lowered" in line for line in lines)


def test_no_room_for_the_kv_cache_is_a_clear_error(monkeypatch):
    from cohort.memory import estimate_memory

    need = estimate_memory(tiny_llama(0).config, dtype=torch.float32, token_budget=4096, chunk_tokens=4096,
                           fused_logprob_kernels=True).total
    with pytest.raises(ConfigError, match=r"token_budget"):
        _run(monkeypatch, int(need / 0.89))

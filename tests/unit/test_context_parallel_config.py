"""train.context_parallel's config checks and the row layout it runs (no process group needed).

Every bad setting is refused by CohortConfig.validate (before any model loads) with the field, the value and
the fix; the zig-zag chunks partition a row and give each rank the same causal work.
"""

from __future__ import annotations

import numpy as np
import pytest

from cohort.config import CohortConfig
from cohort.errors import ConfigError
from cohort.forward.context_attention import chunk_home, chunk_pieces, zigzag_chunks
from cohort.forward.context_rows import local_layout, padded_length


def context_config(cp: int = 2, **train) -> CohortConfig:
    cfg = CohortConfig()
    cfg.train.context_parallel = cp
    cfg.train.share_prompts = False
    for name, value in train.items():
        setattr(cfg.train, name, value)
    return cfg


@pytest.fixture
def four_ranks(monkeypatch):
    """As under `torchrun --nproc-per-node 4` before the process group starts (config checks come first)."""
    monkeypatch.setenv("WORLD_SIZE", "4")


def test_a_valid_context_parallel_config_passes(four_ranks):
    context_config(2).validate()
    context_config(4, sharding="fsdp").validate()
    CohortConfig().validate()  # 1 (the default) needs nothing


@pytest.mark.parametrize("cp, fragments", [
    (0, ("train.context_parallel=0", "1 (off) or more")),
    (3, ("train.context_parallel=3", "must divide the number of ranks (4)", "divisor of 4")),
    (8, ("train.context_parallel=8", "must divide the number of ranks (4)")),
])
def test_a_group_size_that_does_not_divide_the_ranks_is_refused(four_ranks, cp, fragments):
    with pytest.raises(ConfigError) as err:
        context_config(cp).validate()
    for fragment in fragments:
        assert fragment in str(err.value)


def test_one_process_is_told_to_launch_several_ranks(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"train.context_parallel=2 .*number of ranks \(1\).*torchrun "
                                          r"--nproc-per-node 2.*train.context_parallel=1"):
        context_config(2).validate()


def test_the_token_budget_must_cut_into_whole_chunks(four_ranks):
    with pytest.raises(ConfigError, match=r"train.token_budget=16382 .*4 equal chunks; use a multiple of 4"):
        context_config(2, token_budget=16382).validate()
    context_config(2, token_budget=16380).validate()


@pytest.mark.parametrize("field, value, fragment", [
    ("train.share_prompts", True, "train.share_prompts=True is not supported with train.context_parallel=2"),
    ("model.compile_layers", True, "model.compile_layers=True is not supported"),
    ("model.attn_implementation", "flash_attention_2", "model.attn_implementation='flash_attention_2' is not "
                                                        "supported"),
    ("loss.router_aux_loss_coef", 0.001, "loss.router_aux_loss_coef=0.001 is not supported"),
    ("train.router_replay", True, "train.router_replay=True is not supported"),
])
def test_unsupported_combinations_are_refused_by_name(four_ranks, field, value, fragment):
    cfg = context_config(2)
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert fragment in str(err.value) and "train.context_parallel=1" in str(err.value)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_zigzag_chunks_partition_the_row_with_equal_causal_work(size):
    length = 2 * size * 5
    chunks = [zigzag_chunks(length, size, r) for r in range(size)]
    positions = sorted(p for mine in chunks for a, b in mine for p in range(a, b))
    assert positions == list(range(length))
    # causal work of a chunk [a, b): the keys its queries see, sum of (i + 1); equal over ranks
    work = {sum(i + 1 for a, b in mine for i in range(a, b)) for mine in chunks}
    assert len(work) == 1
    for c in range(2 * size):  # chunk_home finds every chunk where zigzag_chunks put it
        rank, slot = chunk_home(c, size)
        assert zigzag_chunks(length, size, rank)[slot] == (c * 5, c * 5 + 5)


def test_chunk_pieces_take_each_segment_from_its_start():
    cu = np.array([0, 8, 21, 29, 37, 40])
    p = chunk_pieces(cu, 10, 20)  # inside segment [8, 21): its queries 10..19 see keys from 8
    assert (p.key_start, p.cu_q, p.cu_k) == (8, [0, 10], [0, 12])
    p = chunk_pieces(cu, 20, 30)  # the end of [8, 21), all of [21, 29), the start of [29, 37)
    assert (p.key_start, p.cu_q, p.cu_k) == (8, [0, 1, 9, 10], [0, 13, 21, 22])
    p = chunk_pieces(cu, 30, 40)  # the rest of [29, 37) and the padding segment
    assert (p.key_start, p.cu_q, p.cu_k) == (29, [0, 7, 10], [0, 8, 11])


def test_padding_and_ownership_of_completion_tokens():
    seqs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10])]  # 5 + 5 tokens -> 12 for 3 ranks (chunks of 2)
    assert padded_length(10, 3) == 12 and padded_length(12, 3) == 12
    mine = [local_layout(seqs, 3, r) for r in range(3)]
    assert [m["length"] for m in mine] == [12] * 3 and list(mine[0]["cu"]) == [0, 5, 10, 12]
    owned = sorted(i for m in mine for i in m["completion_index"].tolist())
    assert owned == list(range(6))  # each completion token's logprob on one rank
    # a label is the token after the hidden state that predicts it, on whichever rank that token lies
    every_label = sorted((int(i), int(lbl)) for m in mine for i, lbl in zip(m["completion_index"], m["labels"]))
    assert [lbl for _, lbl in every_label] == [4, 5, 7, 8, 9, 10]

"""Engine pieces in isolation: block reference counts, the hash-based Gumbel sampler and its filters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cohort.engine.block_manager import BlockManager
from cohort.engine.config import EngineConfig
from cohort.engine.sampler import apply_filters, gumbel_noise, row_key, row_keys
from cohort.engine.sequence import Sequence
from cohort.types import SamplingParams


def _seq(n_tokens: int, seq_id: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, token_ids=list(range(n_tokens)), num_prompt_tokens=n_tokens,
                    params=SamplingParams(), seed=0, request_index=(0, 0), stop_ids=frozenset())


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    blocks = BlockManager(num_blocks=10, block_size=4)
    leader = _seq(9)  # blocks: [0..3], [4..7], [8]
    blocks.allocate(leader)
    followers = [_seq(9, i) for i in (1, 2)]
    copies = blocks.fork(leader, followers)
    assert len(copies) == 2 and all(src == leader.block_table[2] for src, _ in copies)
    assert blocks.num_used_blocks == 3 + 2
    assert [blocks.ref_counts[b] for b in leader.block_table] == [3, 3, 1]
    blocks.free(leader)
    assert blocks.num_used_blocks == 4  # the shared blocks live on in the followers
    for f in followers:
        blocks.free(f)
    assert blocks.num_used_blocks == 0 and sorted(blocks.free_blocks) == list(range(10))


def test_fork_of_a_block_aligned_prompt_copies_nothing():
    blocks = BlockManager(num_blocks=6, block_size=4)
    leader = _seq(8)
    blocks.allocate(leader)
    assert blocks.fork(leader, [_seq(8, 1)]) == []
    assert blocks.num_used_blocks == 2
    assert blocks.blocks_to_prefill(8, 5) == 2 and blocks.blocks_to_prefill(9, 5) == 3 + 4


def test_append_needs_a_block_exactly_at_boundaries():
    blocks = BlockManager(num_blocks=6, block_size=4)
    seq = _seq(4)
    blocks.allocate(seq)
    assert not blocks.needs_block_for_append(seq)  # the decode step writes position 3, in block 0
    seq.token_ids.append(7)
    assert blocks.needs_block_for_append(seq)  # position 4 starts block 1


def test_row_keys_vectorised_equals_scalar():
    seeds = np.array([0, 1, 2**40 + 7, 2**62 - 1], dtype=np.int64)
    positions = np.array([0, 5, 100, 4095], dtype=np.int64)
    assert row_keys(seeds, positions).tolist() == [row_key(int(s), int(p)) for s, p in zip(seeds, positions)]
    assert len(set(row_keys(seeds, positions).tolist())) == 4


def test_gumbel_max_draws_from_the_softmax():
    # 4000 independent keys; the empirical frequencies of argmax(logits + g) approach softmax(logits).
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    keys = torch.from_numpy(row_keys(np.full(4000, 123, dtype=np.int64), np.arange(4000, dtype=np.int64)))
    draws = (logits[None, :] + gumbel_noise(keys, 4)).argmax(-1)
    freq = torch.bincount(draws, minlength=4).float() / 4000
    assert torch.allclose(freq, logits.softmax(-1), atol=0.03)


def test_filters_keep_what_each_rule_allows():
    # probs of row logits log([0.5, 0.3, 0.15, 0.05]):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = apply_filters(logits, top_k=torch.tensor([2, 0, 0]), top_p=torch.tensor([1.0, 0.8, 1.0]),
                        min_p=torch.tensor([0.0, 0.0, 0.2]))
    kept = torch.isfinite(out)
    assert kept[0].tolist() == [True, True, False, False]  # top_k=2
    assert kept[1].tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert kept[2].tolist() == [True, True, True, False]  # min_p: >= 0.2 * 0.5 = 0.1
    assert torch.equal(out[kept], logits[kept])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="kv_cache_fraction"):
        EngineConfig(kv_cache_fraction=1.5)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=100, max_model_len=200)


def test_decode_inputs_pad_rows_into_the_scratch_block():
    """CUDA-graph padding rows must write and read only the scratch block, never a live sequence's KV."""
    from tests.integration.engine_models import tiny_model

    from cohort.engine import CohortEngine

    engine = CohortEngine(tiny_model("llama"), eos_token_ids=[2], block_size=4, max_model_len=64, num_kv_blocks=20)
    runner = engine.runner
    seqs = [_seq(n, i) for i, n in enumerate((6, 9))]
    for seq in seqs:
        engine.blocks.allocate(seq)
    runner._fill_decode_inputs(seqs, rows=5)
    host, tables = runner._row_host.numpy(), runner._tables_host.numpy()
    scratch = runner.scratch_block
    assert host[1, :2].tolist() == [5, 8]  # positions of the last tokens
    assert host[2, :2].tolist() == [seqs[0].block_table[1] * 4 + 1, seqs[1].block_table[2] * 4 + 0]
    assert host[3, :5].tolist() == [6, 9, 1, 1, 1]  # padded rows attend to one slot
    assert host[2, 2:5].tolist() == [scratch * 4] * 3 and tables[2:5, 0].tolist() == [scratch] * 3
    assert tables[1, :3].tolist() == seqs[1].block_table


def test_logits_into_a_shared_buffer_equal_the_lm_head():
    """CUDA graphs write logits into one shared buffer (out=); the values are the LM head's."""
    import torch
    from tests.integration.engine_models import tiny_model

    from cohort.engine.attention import AttentionOps
    from cohort.engine.models.decoder import DecoderForward

    model = tiny_model("qwen2")
    net = DecoderForward(model, AttentionOps(torch.device("cpu"), torch.float32, 16, 16), 128, False)
    hidden = torch.randn(3, model.config.hidden_size)
    buffer = torch.empty(5, model.config.vocab_size)
    with torch.inference_mode():  # as in graph capture
        out = net.logits(hidden, out=buffer[:3])
        assert out.data_ptr() == buffer.data_ptr()
        torch.testing.assert_close(out, model.lm_head(hidden))

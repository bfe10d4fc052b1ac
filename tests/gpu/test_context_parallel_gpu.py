"""Context parallelism on CUDA (train.context_parallel): the flash varlen path of a row split over ranks, bf16.

- One GPU, ranks simulated by threads (tests/helpers/thread_ranks.py; forward only: CUDA's autograd runs every
  backward on one device thread): a row split over 2 and 4 ranks gives the single-rank flash row's logprobs,
  and the flash kernel ran for every layer and local chunk.
- Two GPUs over NCCL (skipped with fewer): 2 context-parallel ranks give the logprobs of 1 rank, and their
  gradients summed are the single-rank gradients (bf16 tolerances, as tests/gpu/test_packing_gpu.py).
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.thread_ranks import ThreadGroup, run_ranks
from transformers import Qwen2Config, Qwen2ForCausalLM

import cohort.forward.context_attention as context_attention
from cohort.distributed.context_parallel import ContextGroup
from cohort.forward.context_rows import pack_context_row
from cohort.forward.packing import packed_forward_logprobs

VOCAB = 1000
SHAPES = [(17, 40), (5, 3), (64, 130), (9, 1), (33, 77)]  # 379 tokens: every chunk boundary inside a sequence


def _model(device="cuda"):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=True,
                      attn_implementation="sdpa", eos_token_id=0, pad_token_id=0)
    return Qwen2ForCausalLM(cfg).to(device, torch.bfloat16)


def _sequences():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(1, VOCAB, (p,), generator=g).tolist(), torch.randint(1, VOCAB, (c,), generator=g).tolist())
            for p, c in SHAPES]


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_row_on_the_flash_path_gives_the_single_rank_logprobs(monkeypatch, size):
    calls = []
    real = context_attention._flash_varlen
    monkeypatch.setattr(context_attention, "_flash_varlen", lambda *a: calls.append(1) or real(*a))
    model, seqs = _model(), _sequences()
    with torch.no_grad():
        single = packed_forward_logprobs(model, seqs, compute_entropy=True)
        copies = [copy.deepcopy(model) for _ in range(size)]
        group = ThreadGroup(size)

        def rank_work(rank: int):
            with torch.no_grad():
                row = pack_context_row(copies[rank], seqs, size=size, rank=rank, gather=group.gather(rank),
                                       reduce=group.reduce(rank))
                return packed_forward_logprobs(copies[rank], seqs, compute_entropy=True, row=row)

        ranks = run_ranks(size, rank_work)
    assert len(calls) == size * 2 * 2  # ranks x layers x local chunks: the flash kernel ran
    for out in ranks:
        assert (out.logprobs - single.logprobs).abs().max().item() < 5e-2
        assert (out.logprobs - single.logprobs).abs().mean().item() < 5e-3
        assert (out.entropy - single.entropy).abs().max().item() < 5e-2


def _nccl_worker(rank: int, world: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        model, seqs = _model(), _sequences()
        results = {}
        for split in (False, True):
            model.zero_grad(set_to_none=True)
            row = ContextGroup(world).pack_row(model, seqs) if split else None
            packed = packed_forward_logprobs(model, seqs, compute_entropy=True, row=row)
            (packed.logprobs.sum() + 0.1 * packed.entropy.sum()).backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
            if split:
                dist.all_reduce(grads)  # each rank's share of the gradient -> the whole
            results[split] = {"logprobs": packed.logprobs.detach().float().cpu(), "grads": grads.cpu()}
        torch.save(results, Path(out) / f"nccl-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_over_nccl_equal_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_nccl_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"nccl-{rank}.pt")
        single, split = got[False], got[True]
        assert (split["logprobs"] - single["logprobs"]).abs().max().item() < 5e-2
        assert torch.nn.functional.cosine_similarity(split["grads"], single["grads"], dim=0).item() > 0.999
        ratio = (split["grads"].norm() / single["grads"].norm()).item()
        assert abs(ratio - 1) < 2e-2  # summed once, not once per rank

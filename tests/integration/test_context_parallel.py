"""Context parallelism (train.context_parallel) on CPU ranks (gloo): 2 ranks splitting every packed row equal 1 rank.

- The packed forward/backward of one row of several sequences of different lengths (one crossing a chunk
  boundary, two of them split over both ranks), on a tiny Llama and a tiny Qwen2 (3 query heads per KV head) in
  float32: each rank's logprobs and entropy equal the single-rank row's, and for a token-level (dapo), a
  sequence-level (gspo) and a per-sequence-mean (grpo) loss the loss equals the single-rank loss and the
  gradients summed over the 2 ranks equal the single-rank gradients. Also with a sliding-window Mistral and
  under gradient checkpointing (the attention's collectives run again in the recomputation).
- The trainer: 2 steps of the toy task (tests/integration/test_trainer_learns.py) launched by torchrun on 2 gloo
  ranks with train.context_parallel=2 (sharding none and fsdp) log the metrics and end with the weights of a
  1-rank run of the same global batch (tests/helpers/rank_worker.py with its CONTEXT_PARALLEL argument).

Workers write what they observe; the test process compares (a failure reads as an assertion).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.helpers.gloo_ranks import leave_rank
from tests.integration.test_dcp_checkpoint import _init, spawn
from tests.integration.test_eight_ranks import COMPARED, WEIGHT_ATOL
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from cohort.algorithms import LossInputs, build_policy_loss
from cohort.distributed.context_parallel import ContextGroup
from cohort.forward.context_rows import local_layout
from cohort.forward.packing import packed_forward_logprobs
from cohort.run.logging import read_jsonl

REPO = Path(__file__).resolve().parents[2]
CONTEXT_WORKER = REPO / "tests" / "helpers" / "rank_worker.py"
VOCAB = 96
# (prompt length, completion length): 8 + 13 + 8 + 8 = 37 tokens, padded to 40, chunks of 10 held by rank 0
# ([0, 10), [30, 40)) and rank 1 ([10, 20), [20, 30)); sequence 1 ([8, 21)) spans 3 chunks on both ranks,
# sequence 3 ([29, 37)) crosses the boundary at 30 between the ranks.
SHAPES = [(3, 5), (4, 9), (2, 6), (5, 3)]
# name -> (loss.loss_type, its parameters); every loss with a small entropy bonus (the entropy's gradient too)
LOSSES = {"dapo": ("dapo", {}), "gspo": ("grpo", {"importance_sampling_level": "sequence"}), "grpo": ("grpo", {})}
FAMILIES = ("llama", "qwen2", "mistral", "llama-checkpointed")
TOL = {"rtol": 1e-5, "atol": 1e-6}


def tiny(family: str) -> torch.nn.Module:
    """A 2-layer float32 model, seeded (every rank builds the same)."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "num_hidden_layers": 2, "intermediate_size": 64, "max_position_embeddings": 128}
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                             head_dim=8, tie_word_embeddings=True, **common))
    elif family == "mistral":  # a window of 6 keys: shorter than sequence 1, so the window cuts inside it
        model = MistralForCausalLM(MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                                 sliding_window=6, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **common))
    model.config._attn_implementation = "sdpa"
    if family.endswith("checkpointed"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.float().train()


def sequences() -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(1, VOCAB, (p,), generator=g).tolist(), torch.randint(1, VOCAB, (c,), generator=g).tolist())
            for p, c in SHAPES]


def loss_inputs(packed, width: int) -> dict:
    """Old logprobs off the current ones (ratios away from 1, some clipped), mixed-sign advantages, one masked
    token: every term of the losses is exercised."""
    g = torch.Generator().manual_seed(2)
    lp = packed.padded("logprobs")
    mask = torch.zeros(len(SHAPES), width)
    for i, (_, c) in enumerate(SHAPES):
        mask[i, :c] = 1.0
    mask[1, 4] = 0.0
    old = lp.detach() + 0.3 * torch.randn(lp.shape, generator=g)
    return {"logprobs": lp, "old_logprobs": old * mask, "mask": mask, "entropy": packed.padded("entropy"),
            "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]), "num_tokens": mask.sum(),
            "num_sequences": len(SHAPES)}


def forward_backward(model, seqs, loss_type: str, row=None) -> dict:
    model.zero_grad(set_to_none=True)
    packed = packed_forward_logprobs(model, seqs, compute_entropy=True, row=row)
    width = max(c for _, c in SHAPES)
    name, params = LOSSES[loss_type]
    loss = build_policy_loss(name, {**params, "entropy_coef": 0.01})(LossInputs(**loss_inputs(packed, width)))
    loss.loss.backward()
    return {"logprobs": packed.logprobs.detach().clone(), "entropy": packed.entropy.detach().clone(),
            "loss": loss.loss.detach().clone(),
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}}


def _exactness_worker(rank: int, world: int, out: str, init_file: str) -> None:
    _init(rank, world, init_file)
    try:
        group = ContextGroup(world)
        results = {}
        for family in FAMILIES:
            model, seqs = tiny(family), sequences()
            for loss_type in LOSSES:
                single = forward_backward(model, seqs, loss_type)
                split = forward_backward(model, seqs, loss_type, row=group.pack_row(model, seqs))
                for g in split["grads"].values():  # each rank's share of the gradient -> the whole
                    dist.all_reduce(g, group=group.group)
                results[family, loss_type] = {"single": single, "split": split}
        torch.save(results, Path(out) / f"exact-{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.fixture(scope="module")
def exactness(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("context")
    spawn(_exactness_worker, 2, out)
    return [torch.load(out / f"exact-{r}.pt") for r in range(2)]


def test_the_row_crosses_the_chunk_boundaries():
    """The layout the exactness test relies on: sequences split over both ranks' chunks."""
    seqs = sequences()
    mine = [local_layout(seqs, 2, r) for r in range(2)]
    assert [m["chunks"] for m in mine] == [[(0, 10), (30, 40)], [(10, 20), (20, 30)]]
    assert mine[0]["length"] == 40 and list(mine[0]["cu"]) == [0, 8, 21, 29, 37, 40]
    # every completion token's logprob is computed on exactly one rank
    owned = sorted(i for m in mine for i in m["completion_index"].tolist())
    assert owned == list(range(sum(c for _, c in SHAPES)))
    # global positions: rank 1's first token is token 2 of sequence 1 (row position 10)
    assert mine[1]["positions"][0] == 2 and mine[0]["positions"][10] == 1  # row position 30: sequence 3's second


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("loss_type", LOSSES)
def test_two_context_parallel_ranks_equal_one_rank(exactness, family, loss_type):
    for rank, results in enumerate(exactness):
        single, split = results[family, loss_type]["single"], results[family, loss_type]["split"]
        for what in ("logprobs", "entropy", "loss"):
            torch.testing.assert_close(split[what], single[what], **TOL, msg=f"rank {rank}: {what}")
        assert sorted(split["grads"]) == sorted(single["grads"])
        for name, grad in single["grads"].items():
            torch.testing.assert_close(split["grads"][name], grad, **TOL, msg=f"rank {rank}: grad of {name}")
        assert any(g.abs().max() > 1e-3 for g in single["grads"].values())  # a gradient worth comparing


# ------------------------------------------------------------------------------- the trainer, 2 steps
def _launch_context(out: Path, ranks: int, sharding: str, context_parallel: int) -> None:
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), str(CONTEXT_WORKER), str(out), sharding, "2", str(context_parallel)],
                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("context-trainer") / "one"
    _launch_context(out, 1, "none", 1)
    return out


@pytest.mark.slow  # two torchrun launches
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_trainer_with_context_parallel_equals_one_rank(one_rank, tmp_path, sharding):
    _launch_context(tmp_path / "cp", 2, sharding, 2)
    a = {r["step"]: r for r in read_jsonl(one_rank / "run" / "metrics.jsonl")}
    b = {r["step"]: r for r in read_jsonl(tmp_path / "cp" / "run" / "metrics.jsonl")}
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        for key in (*COMPARED, "loss"):
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-4, abs_tol=1e-5), (step, key, a[step][key],
                                                                                        b[step][key])
        # The sharp checks: the trainer's logprobs against the engine's, token by token (chunk-local attention
        # puts them 0.1 to 0.6 apart, where the tiny model's gradients and Adam's steps barely move), and the
        # entropy (3e-5 off with chunk-local attention; 1 rank and 2 agree to float32 rounding).
        assert b[step]["sampling/sampling_logp_difference/max"] < 1e-5, b[step]
        assert math.isclose(a[step]["entropy"], b[step]["entropy"], rel_tol=2e-6), (a[step]["entropy"],
                                                                                   b[step]["entropy"])
    weights = [torch.load(tmp_path / "cp" / f"weights-{r}.pt") for r in range(2)]
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])  # the ranks stay in lockstep
    single = torch.load(one_rank / "weights-0.pt")
    assert sorted(single) == sorted(weights[0])
    for name, w in single.items():
        torch.testing.assert_close(weights[0][name], w, rtol=0, atol=WEIGHT_ATOL, msg=name)

"""Several processes beyond the 2-vs-1 invariant of test_distributed.py.

- Two "nodes" on one host: two torchrun launchers (`--nnodes 2 --nproc-per-node 1`) meet through torchrun's
  c10d rendezvous, as two machines would (docs/training.md, "Several GPUs and nodes"), and train on the CPU
  (gloo); both exit 0 and only rank 0 writes the run directory and reports.
- Dynamic sampling across ranks: each rank ends every step with exactly its share of groups, the ranks agree
  on the number of tries, and the metrics describe the whole step.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.dist_rewards import informative_on_rank0_only
from tests.helpers.gloo_ranks import enter_rank, leave_rank
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model, toy_rows, write_toy_workspace
from tests.integration.test_trainer_learns import toy_config

from cohort.data import load_prompt_dataset
from cohort.rewards import RewardRunner
from cohort.run.logging import read_jsonl
from cohort.setup import build_components

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_through_c10d_rendezvous(tmp_path):
    model_dir, toy = write_toy_workspace(tmp_path / "ws")
    out = tmp_path / "run"  # one run directory both "nodes" see, as a shared filesystem would provide
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{_free_port()}",
           "--rdzv-id", f"cohort-test-{os.getpid()}",
           "-m", "cohort.cli", "train", f"model.name_or_path={model_dir}", f"data.source={toy}",
           "reward.funcs=[tests.helpers.toy_task:digit_share]", "train.max_steps=2", "train.prompts_per_step=2",
           "generation.num_generations=2", "generation.max_completion_length=4", f"run.output_dir={out}",
           "run.report_to=[jsonl]", "train.dist_timeout_s=60"]
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "reward" in r] == [1, 2]
    assert sum(o.count("run directory:") for o in outputs) == 1, outputs  # rank 0 alone reports


def _dynamic_rank(rank: int, world: int, out: str, init_file: str) -> None:
    enter_rank()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import cohort.trainer as trainer_module

        cfg = toy_config(Path(out), steps=2)
        cfg.train.device = "cpu"
        cfg.train.prompts_per_step = 4  # 2 groups per rank
        cfg.generation.num_generations, cfg.generation.max_completion_length = 2, 4
        cfg.reward.dynamic_sampling, cfg.reward.max_resample_tries = True, 3
        groups: list[int] = []
        collect = trainer_module.collect_rollouts

        def counting(*args, **kwargs):
            batch = collect(*args, **kwargs)
            groups.append(len(batch) // cfg.generation.num_generations)
            return batch

        trainer_module.collect_rollouts = counting
        tok = make_tiny_tokenizer()
        comp = build_components(cfg, policy=tiny_model(tok), tokenizer=tok, train_data=load_prompt_dataset(
            toy_rows()).encode(tok, 64), reward_runner=RewardRunner([informative_on_rank0_only]))
        result = trainer_module.train(cfg, comp)
        keys = ("sampling/tries", "sampling/groups_drawn", "frac_reward_zero_std", "reward", "num_tokens")
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"groups": groups, "history": [{k: m[k] for k in keys} for m in result.history]}))
    finally:
        dist.destroy_process_group()
    leave_rank()


def test_dynamic_sampling_across_ranks(tmp_path):
    world = 2
    mp.spawn(_dynamic_rank, args=(world, str(tmp_path), str(tmp_path / "init")), nprocs=world, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(r["groups"] == [2, 2] for r in ranks), ranks  # every rank keeps exactly its share, every step
    assert ranks[0]["history"] == ranks[1]["history"]  # the ranks agree on every step metric
    for m in ranks[0]["history"]:
        # rank 0 fills its 2 groups on the first try; rank 1 sees only all-equal groups: it draws 2, then
        # min(4 x 2, 2 / 0) = 8 twice, and its last try fills its share with all-equal groups
        assert m["sampling/tries"] == 3.0
        assert m["sampling/groups_drawn"] == 2 + 2 + 8 + 8
        assert m["frac_reward_zero_std"] == pytest.approx(18 / 20)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]

"""`cohort serve` on a second GPU: weights pushed over NCCL from the trainer's GPU, greedy tokens equal to an
in-process engine on the same weights; a server killed or frozen in the middle of an NCCL push gives the named
error (or exit code 75 with it) within the liveness timeout; a restarted server gets the weights again over a
new NCCL group. Needs 2 GPUs (NCCL cannot join two processes on one device)."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import torch
from tests.helpers.serving import ServerProcess
from tests.helpers.serving_trainer import TrainerProcess
from tests.helpers.toy_task import tiny_model, write_toy_workspace

from cohort.engine import CohortEngine
from cohort.policy.model import load_policy
from cohort.remote.liveness import EXIT_SERVER_LOST
from cohort.serving import RemoteEngine
from cohort.setup.engine import eos_ids
from cohort.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA GPUs")


def test_nccl_push_and_greedy_generation_match_the_in_process_engine(tmp_path):
    model_dir, _ = write_toy_workspace(tmp_path)
    _, tok = load_policy(str(model_dir), dtype=torch.bfloat16)
    policy = tiny_model(tok, seed=5).to(device="cuda:0", dtype=torch.bfloat16)
    server = ServerProcess(model_dir, device="cuda", env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        remote = RemoteEngine(server.address, policy, bucket_bytes=64 << 10)
        assert remote.last_push["buckets"] > 1
        assert remote.client.request("GET", "/health", phase="test")["backend"] == "nccl"
        prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3?")]
        params = SamplingParams(n=2, max_tokens=16, temperature=0.0)
        local = CohortEngine(policy, tok, eos_token_ids=eos_ids(tok, policy), kv_cache_fraction=0.05)
        expected = local.generate(prompts, params)
        served = remote.generate(prompts, params)
        assert [c.token_ids for g in served for c in g] == [c.token_ids for g in expected for c in g]
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1 * torch.randn_like(p))
        remote.sync_weights()
        local.sync_weights()
        served = remote.generate(prompts, params)
        assert [c.token_ids for g in served for c in g] == [c.token_ids for g in local.generate(prompts, params)
                                                            for c in g]
        assert {c.version for g in served for c in g} == {1}
    finally:
        server.kill()


# Servers that start in seconds: no CUDA graphs (the trainer's in-process engine is eager too), a small batch
# and KV pool (the GPU is shared with the next test's server).
FAST = ("--enforce-eager", "--max-num-seqs", "16", "--kv-cache-fraction", "0.3")
LIVENESS_S = 3.0  # generation.server_liveness_timeout_s of the fault tests
# liveness 3 s (+ a /health probe of 1.5 s and the 1 s poll), the abort's grace 10 s before exit code 75, the
# wait for a restart (connect timeout 2 s): far below NCCL's group timeout (45 s) and HTTP's 60 s
LOST_WITHIN_S = 30.0


def _server_gpu() -> str:
    """The second visible GPU, as the server's CUDA_VISIBLE_DEVICES (the trainer keeps cuda:0, the first)."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[1] if len(visible) >= 2 else "1"


def _logs(trainer: TrainerProcess, server: ServerProcess) -> str:
    return (f"\n--- trainer stderr (exit code {trainer.proc.poll()}):\n{trainer.stderr[-6000:]}"
            f"\n--- server log (exit code {server.proc.poll()}):\n{''.join(server.log)[-4000:]}")


def _health(server: ServerProcess) -> dict:
    with urllib.request.urlopen(urllib.request.Request(f"http://{server.address}/health", headers=server.headers),
                                timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("fault", ["exit_mid_push", "stop_mid_push"])
def test_a_server_lost_in_the_middle_of_an_nccl_push_gives_the_named_error_within_the_timeout(tmp_path, fault):
    """The server exits (code 17) or freezes (SIGSTOP) once the first bucket of version 1 is under way (the
    fault hook COHORT_SERVE_FAULT): the trainer's broadcast waits on the GPU for a peer that never comes. The
    liveness watch must end it within LOST_WITHIN_S either way docs/serving.md allows: ServerUnavailable naming
    host, port and "weight push" (the abort made the broadcast return), or the process exiting with code 75
    and that message on stderr (it did not). Never a hang, never NCCL's watchdog abort."""
    model_dir, _ = write_toy_workspace(tmp_path)
    trainer = TrainerProcess(model_dir)  # first: its imports overlap the server's start
    server = None
    try:
        server = ServerProcess(model_dir, *FAST, "--group-timeout-s", "45", device="cuda",
                               env={"CUDA_VISIBLE_DEVICES": _server_gpu(), "COHORT_SERVE_FAULT": f"{fault}:1"})
        ready = trainer.ask("connect", 120, address=server.address, seed=5, server_timeout_s=60.0,
                            connect_timeout_s=2.0, liveness_timeout_s=LIVENESS_S, bucket_bytes=16 << 10)
        assert ready["backend"] == "nccl" and ready["buckets"] > 2, ready  # many buckets: the fault lands mid-push
        where = f"{server.host}:{server.port}"
        # the worker's own timeout ends a sync still running after LOST_WITHIN_S (faulthandler, exit code 1):
        # that fails below as a process that ended without exit code 75
        out = trainer.call("sync", LOST_WITHIN_S)
        if out is None:  # the broadcast could not be cancelled: the process ended, naming the server
            assert trainer.proc.returncode == EXIT_SERVER_LOST, _logs(trainer, server)
            assert where in trainer.stderr and "stopped answering during weight push" in trainer.stderr, \
                _logs(trainer, server)
            outcome = f"exit code {EXIT_SERVER_LOST}"
        else:  # the abort made the broadcast return: the error is raised, the process lives on
            assert out["error"] is not None, f"the push to a lost server succeeded: {out}{_logs(trainer, server)}"
            assert where in out["error"] and "weight push" in out["error"], out["error"]
            assert out["version"] == 0 and out["group_dropped"], out  # nothing counted; the next push: a new group
            outcome = "ServerUnavailable raised"
        if out is not None:  # and the process still exits, never hangs: as the CLI does, with code 75 once an NCCL
            # group was aborted (measured: with a frozen server a normal teardown waits forever on it)
            assert trainer.exit() in (0, EXIT_SERVER_LOST), _logs(trainer, server)
        if fault == "exit_mid_push":
            assert server.proc.wait(10) == 17, _logs(trainer, server)
        print(f"{fault}: {outcome} within {LOST_WITHIN_S:g} s: {out['error'] if out else trainer.stderr[-600:]}")
    finally:
        trainer.kill()
        if server is not None:
            server.kill()  # a frozen (SIGSTOP) server too: SIGKILL ends it


def test_the_trainer_reconnects_to_a_restarted_server_and_re_pushes_over_nccl(tmp_path):
    """The server is killed between pushes and restarted on the same port (weights as loaded): the next
    generate notices, joins a new NCCL group, re-pushes version 1 and retries; restarted again before a push,
    the push of version 2 lands there. Greedy tokens always equal the trainer's in-process engine."""
    model_dir, _ = write_toy_workspace(tmp_path)
    env = {"CUDA_VISIBLE_DEVICES": _server_gpu()}
    trainer = TrainerProcess(model_dir)
    server = None

    def check_generation(version: int, timeout_s: float = 120) -> None:
        out = trainer.ask("generate", timeout_s)
        assert out["served"] and all(out["served"]), out
        assert out["served"] == out["local"], out
        assert out["versions"] == [version], out

    try:
        server = ServerProcess(model_dir, *FAST, device="cuda", env=env)
        ready = trainer.ask("connect", 120, address=server.address, seed=11, server_timeout_s=60.0,
                            connect_timeout_s=60.0, liveness_timeout_s=30.0, bucket_bytes=64 << 10)
        assert ready["backend"] == "nccl" and ready["buckets"] > 1, ready
        trainer.ask("perturb", 30, seed=1)
        out = trainer.ask("sync", 120)
        assert out["error"] is None and out["version"] == 1, out
        check_generation(1)
        port = server.port
        server.kill()
        server = ServerProcess(model_dir, *FAST, port=port, device="cuda", env=env)  # same port, weights as loaded
        check_generation(1, timeout_s=180)  # notices the restart, re-pushes version 1 over a new group, retries
        health = _health(server)
        assert health["pushed"] is True and health["version"] == 1 and health["backend"] == "nccl", health
        server.kill()
        server = ServerProcess(model_dir, *FAST, port=port, device="cuda", env=env)  # restarted again, before a push
        trainer.ask("perturb", 30, seed=2)
        out = trainer.ask("sync", 180)  # finds the new server and sends version 2 there
        assert out["error"] is None and out["version"] == 2, f"{out}{_logs(trainer, server)}"
        check_generation(2)
        assert _health(server)["version"] == 2
        assert trainer.exit() == 0, _logs(trainer, server)
    finally:
        trainer.kill()
        if server is not None:
            server.kill()

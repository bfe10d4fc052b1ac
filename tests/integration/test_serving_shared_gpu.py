"""A trainer and its server on the same GPU: NCCL refuses two ranks of one group on one device ("Duplicate GPU
detected"; every served calculator-agent run on one H200 failed so at its first push), so the trainer names its
GPU in /weights/init and a server holding that GPU opens a gloo group instead, receiving into host memory.
On the CPU: an in-process server made to look like a GPU server (NCCL backend, a GPU UUID), a trainer whose
weights report the same UUID, the push over HTTP and gloo, and the served tokens equal to the pushed weights'."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from tests.helpers.toy_task import tiny_model, write_toy_workspace

from cohort.engine import CohortEngine
from cohort.errors import ConfigError
from cohort.policy.model import load_policy
from cohort.remote import weights as W
from cohort.serving import RemoteEngine
from cohort.serving.engine_server import EngineServer, Replica
from cohort.serving.server import make_http_server
from cohort.setup.engine import eos_ids
from cohort.types import SamplingParams

KEY = "test-key"
GREEDY = SamplingParams(n=2, max_tokens=12, temperature=0.0)
SERVER_GPU = "GPU-11111111-2222-3333-4444-555555555555"


@contextmanager
def gpu_like_server(tmp_path):
    """(the server, its address, the tokenizer): a CPU engine whose server believes it holds SERVER_GPU."""
    model_dir, _ = write_toy_workspace(tmp_path)
    model, tok = load_policy(str(model_dir), dtype=torch.float32)
    engine = CohortEngine(model, tok, eos_token_ids=eos_ids(tok, model))
    server = EngineServer([Replica(model, engine, torch.device("cpu"), threading.Lock())], tok, model_name="m")
    server.backend, server._gpus = "nccl", {SERVER_GPU}  # as on a GPU; the group itself stays on the host
    http = make_http_server(server, "127.0.0.1", 0, api_key=KEY)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield server, f"127.0.0.1:{http.server_address[1]}", tok
    finally:
        http.shutdown()
        http.server_close()


def _tokens(groups) -> list[list[int]]:
    return [c.token_ids for g in groups for c in g]


def test_a_trainer_on_the_servers_gpu_pushes_over_gloo(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(W, "gpu_uuid", lambda device: SERVER_GPU)  # the trainer's weights sit on that GPU
    with gpu_like_server(tmp_path) as (server, address, tok):
        policy = tiny_model(tok, seed=7)  # other weights than the served model's
        remote = RemoteEngine(address, policy, api_key=KEY, bucket_bytes=64 << 10)
        assert remote._group is not None and remote._group[1].type == "cpu"  # the trainer's end: host memory
        assert server._group_backend == "gloo" and remote.last_push["buckets"] > 1
        prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3?")]
        local = CohortEngine(policy, tok, eos_token_ids=eos_ids(tok, policy))
        groups = remote.generate(prompts, GREEDY)
        assert _tokens(groups) == _tokens(local.generate(prompts, GREEDY))
        assert {c.version for g in groups for c in g} == {0}
        remote.sync_weights()  # a second push on the same group
        assert server.version == 1
    said = capsys.readouterr().out
    assert said.count("weights travel over gloo") == 1 and "serve from another GPU" in said


def test_a_trainer_on_another_gpu_still_gets_nccl(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "gpu_uuid", lambda device: "GPU-99999999-0000-0000-0000-000000000000")
    with gpu_like_server(tmp_path) as (server, address, tok):
        # NCCL answered: a trainer whose policy is on the CPU is told so (the fast path was not replaced)
        with pytest.raises(ConfigError, match="receives weights over NCCL"):
            RemoteEngine(address, tiny_model(tok, seed=7), api_key=KEY)
        assert server._group_backend == "nccl"


def test_the_gpu_field_is_bounded(tmp_path):
    with gpu_like_server(tmp_path) as (_, address, _tok):
        remote = RemoteEngine(address, api_key=KEY)
        for bad, said in (("G" * 65, "gpu has 65 characters"), (7, "gpu=7 is not a string")):
            with pytest.raises(Exception, match=said):
                remote.client.request("POST", "/weights/init", {"gpu": bad}, phase="test")

"""`cohort serve` on the CPU, in a subprocess: same tokens as the in-process engine, weight pushes equal to
loading the state dict, refused mismatches, named errors from a dead or silent server within the timeout,
reconnection to a restarted server, and OpenAI-shaped answers."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest
import torch
from tests.helpers.serving import ServerProcess
from tests.helpers.threads import run_at_once
from tests.helpers.tiny_models import tiny_llama
from tests.helpers.toy_task import tiny_model, write_toy_workspace

from cohort.engine import CohortEngine
from cohort.policy.model import load_policy
from cohort.serving import RemoteEngine, ServerUnavailable, WeightMismatchError
from cohort.setup.engine import eos_ids
from cohort.types import SamplingParams

PARAMS = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    model_dir, data = write_toy_workspace(tmp_path_factory.mktemp("serve"))
    return model_dir, data


@pytest.fixture(scope="module")
def server(workspace):
    proc = ServerProcess(workspace[0], "--replicas", "2")  # two CPU replicas: the prompts split between them
    yield proc
    proc.kill()


def _local(model, tok) -> CohortEngine:
    return CohortEngine(model, tok, eos_token_ids=eos_ids(tok, model))


def _prompts(tok) -> list[list[int]]:
    return [tok(t)["input_ids"] for t in ("Say the digit 3", "Say the digit 7 many times", "What is 2 + 3?")]


def _flat(groups):
    return [(c.token_ids, c.finish_reason) for g in groups for c in g]


def _same(served, local) -> bool:
    """Same tokens and finish reasons; logprobs equal up to float rounding (the two replicas decode smaller
    batches than one engine does, which changes the last bits of a matmul; one replica is bit-exact, see
    test_serving_training.py)."""
    assert _flat(served) == _flat(local)
    for a, b in zip([c for g in served for c in g], [c for g in local for c in g]):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    return True


def test_served_generation_equals_the_in_process_engine(server, workspace):
    model, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    remote = RemoteEngine(server.address)  # no policy: reads the weights as loaded, pushes nothing
    served = remote.generate(_prompts(tok), PARAMS)
    assert _same(served, _local(model, tok).generate(_prompts(tok), PARAMS))
    assert {c.version for g in served for c in g} == {0}


def test_weight_push_equals_loading_the_state_dict(server, workspace):
    _, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    other = tiny_model(tok, seed=7)  # same architecture, different weights
    remote = RemoteEngine(server.address, other, bucket_bytes=64 << 10)  # several buckets
    assert remote.last_push["buckets"] > 1
    loaded, _ = load_policy(str(workspace[0]), dtype=torch.float32)
    loaded.load_state_dict(other.state_dict())
    expected = _local(loaded, tok).generate(_prompts(tok), PARAMS)
    assert _same(remote.generate(_prompts(tok), PARAMS), expected)
    with torch.no_grad():  # an optimizer step: the next push is version 1 and changes the outputs the same way
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    remote.sync_weights()
    loaded.load_state_dict(other.state_dict())
    served = remote.generate(_prompts(tok), PARAMS)
    assert _same(served, _local(loaded, tok).generate(_prompts(tok), PARAMS))
    assert _flat(served) != _flat(expected)
    assert {c.version for g in served for c in g} == {1}


def test_a_lora_policy_is_served_as_its_merged_model(server, workspace):
    """generation.placement=server with model.lora_r > 0: the push carries the base model's names with the
    adapters merged in, so the server samples what the merged policy would, and a push after an adapter
    update changes that the same way."""
    import copy

    import peft

    _, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    policy = peft.get_peft_model(tiny_model(tok, seed=3), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # trained adapters (B starts at zero)
                p.copy_(0.2 * torch.randn_like(p))
    remote = RemoteEngine(server.address, policy)

    def merged_generation():
        model = copy.deepcopy(policy).merge_and_unload()
        return _local(model, tok).generate(_prompts(tok), PARAMS)

    first = merged_generation()
    assert _same(remote.generate(_prompts(tok), PARAMS), first)
    with torch.no_grad():  # an optimizer step on the adapters only
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn_like(p))
    remote.sync_weights()
    served = remote.generate(_prompts(tok), PARAMS)
    assert _same(served, merged_generation())
    assert _flat(served) != _flat(first)


def test_multi_turn_rollouts_on_the_server_follow_the_regeneration_contract(server, workspace):
    """Tool-calling rollouts against a server (RemoteEngine.generate_turns): each round of later turns is one
    request (one SamplingParams per conversation, split over the 2 replicas), and the served rollout equals the
    loop over the in-process engine's `generate` with one call per conversation: tokens, masks (context tokens
    0), turn counts and the version."""
    from cohort.engine.turns_by_regeneration import generate_turns_by_regeneration

    _, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    policy = tiny_model(tok, seed=11)
    # pushes these weights as version 0; re-sends every turn (sessions: test_serving_sessions.py)
    remote = RemoteEngine(server.address, policy, use_sessions=False)
    # half the vocabulary stops a turn, so conversations end turns early and the tool path runs
    params = SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=3,
                            stop_token_ids=tuple(range(0, len(tok), 2)))
    context = [5, 6, 7]

    def on_turn_end(turn):
        return list(context) if turn.turn < 3 else None  # a "tool result" after each of the first two turns

    served = remote.generate_turns(_prompts(tok), params, on_turn_end)  # one request per round
    local_engine = _local(policy, tok)
    local = generate_turns_by_regeneration(local_engine.generate, _prompts(tok), params, on_turn_end)
    assert _same(served, local)  # batched rounds on the server draw what one call per conversation draws
    batched = generate_turns_by_regeneration(local_engine.generate, _prompts(tok), params, on_turn_end,
                                             batched=True)
    assert _flat(batched) == _flat(local)
    status, error = _post_error(server, "/generate", {"prompts": [[1, 2], [3]], "params": [{"max_tokens": 2}]})
    assert status == 400 and "got 1 for 2 prompts" in json.dumps(error)  # one params per prompt, or one
    flat = [c for g in served for c in g]
    assert [c.mask for c in flat] == [c.mask for g in local for c in g]
    assert [c.turns for c in flat] == [c.turns for g in local for c in g]
    assert any(c.turns > 1 for c in flat)  # the multi-turn path ran
    for c in flat:
        assert len(c.mask) == len(c.token_ids) == len(c.logprobs)
        assert sum(1 for m in c.mask if m == 0) == len(context) * (c.turns - 1)
        assert c.version == 0


def test_a_push_that_does_not_match_is_refused(server):
    before = _get(server, "/health")
    with pytest.raises(WeightMismatchError) as err:
        RemoteEngine(server.address, tiny_llama(0))  # another architecture (vocab 64, hidden 32)
    text = str(err.value)
    assert f"{server.host}:{server.port}" in text and "refused" in text and "shape" in text
    assert "model.embed_tokens.weight" in text
    after = _get(server, "/health")
    assert (after["version"], after["pushed"]) == (before["version"], before["pushed"])  # nothing changed


def test_openai_endpoints_answer_in_openai_shapes(server):
    out = _post(server, "/v1/completions", {"prompt": ["Say the digit 3", "What is"], "max_tokens": 5, "seed": 1,
                                             "logprobs": 1})
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert {"id", "object", "created", "model", "choices", "usage", "system_fingerprint"} <= set(out)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        assert isinstance(c["text"], str) and c["finish_reason"] in ("stop", "length")
        assert len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) <= 5
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say 3"}], "n": 2,
                                                   "max_tokens": 4, "temperature": 0.0})
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert [c["message"]["role"] for c in chat["choices"]] == ["assistant", "assistant"]
    assert all(isinstance(c["message"]["content"], str) for c in chat["choices"])
    assert _get(server, "/v1/models")["data"][0]["object"] == "model"
    status, err = _post_error(server, "/v1/completions", {"prompt": "x", "stream": True})
    assert status == 400 and "stream" in err["error"]["message"] and err["error"]["param"] == "stream"
    status, err = _post_error(server, "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user",
                                                                                               "content": "x"}]})
    assert status == 404 and "gpt-4" in err["error"]["message"]


def test_dead_and_silent_servers_give_a_named_error_within_the_timeout(workspace):
    model, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    proc = ServerProcess(workspace[0])
    try:
        remote = RemoteEngine(proc.address, model, timeout_s=2.0, connect_timeout_s=2.0)
        os.kill(proc.proc.pid, signal.SIGSTOP)  # alive but silent
        with pytest.raises(ServerUnavailable) as err:
            remote.generate(_prompts(tok), PARAMS)
        assert f"127.0.0.1:{proc.port}" in str(err.value) and "during generate" in str(err.value)
        assert "within 2 s" in str(err.value), err.value  # cut at the client's 2 s timeout, not left waiting
        os.kill(proc.proc.pid, signal.SIGCONT)
        proc.kill()  # dead
        with pytest.raises(ServerUnavailable) as err:
            remote.sync_weights()
        assert f"127.0.0.1:{proc.port}" in str(err.value) and "weight push" in str(err.value)
    finally:
        proc.kill()


@pytest.mark.parametrize("fault", ["stop_mid_push", "exit_mid_push"])
def test_a_server_lost_in_the_middle_of_a_push_gives_the_named_error_within_the_timeout(workspace, fault):
    """The server freezes (SIGSTOP: its sockets stay open, gloo would wait --group-timeout-s=20 s and HTTP
    server_timeout_s=60 s) or exits once the first bucket of version 1 has arrived; the trainer names host,
    port and phase within the liveness timeout, and the push is abandoned, not retried forever."""
    _, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    policy = tiny_model(tok, seed=5)
    proc = ServerProcess(workspace[0], env={"COHORT_SERVE_FAULT": f"{fault}:1"})
    try:
        remote = RemoteEngine(proc.address, policy, timeout_s=60.0, connect_timeout_s=2.0, liveness_timeout_s=3.0,
                              bucket_bytes=16 << 10)  # many buckets: the fault lands mid-push
        assert remote.last_push["buckets"] > 2
        with pytest.raises(ServerUnavailable) as err:
            remote.sync_weights()
        text = str(err.value)
        # ended by the liveness watch (3 s) or, for a server gone, by the lost connection; never by gloo's 20 s
        # timeout ("Timed out") or HTTP's 60 s one ("within 60 s")
        liveness = "stopped answering during weight push" in text and "liveness_timeout_s=3" in text
        lost = fault == "exit_mid_push" and "during weight push failed" in text
        assert (liveness or lost) and "imed out" not in text and "within 60 s" not in text, text
        assert f"127.0.0.1:{proc.port}" in text and "weight push" in text, text
        assert remote.version == 0 and remote._group is None  # nothing counted; the next push joins a new group
        if fault == "exit_mid_push":
            assert proc.proc.wait(10) == 17
    finally:
        proc.kill()


def test_a_stuck_collective_that_cannot_be_cancelled_exits_the_process_with_the_named_error(tmp_path):
    """NCCL's case, on the CPU: a push whose collective never returns once the server is gone (the GPU stream
    would wait on it) ends the process with EXIT_SERVER_LOST and the named error on stderr, not a hang."""
    import socket
    import subprocess
    import sys

    from cohort.remote.liveness import EXIT_SERVER_LOST

    with socket.socket() as s:  # a port nothing listens on: a server that is gone
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = f"""
import threading
from cohort.remote.client import ServerClient
from cohort.remote.liveness import run_watched
client = ServerClient("127.0.0.1", {port}, timeout_s=5, connect_timeout_s=1)
run_watched(lambda cancelled: threading.Event().wait(), client, phase="weight push", timeout_s=1.0, poll_s=0.2,
            must_return=True, grace_s=0.5)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)  # not a hang
    assert out.returncode == EXIT_SERVER_LOST, out.stderr
    assert f"127.0.0.1:{port}" in out.stderr and "stopped answering during weight push" in out.stderr


def test_the_trainer_reconnects_to_a_restarted_server_and_re_pushes(workspace):
    _, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    policy = tiny_model(tok, seed=11)
    proc = ServerProcess(workspace[0])
    try:
        remote = RemoteEngine(proc.address, policy, timeout_s=30.0, connect_timeout_s=60.0)
        remote.sync_weights()
        first = _flat(remote.generate(_prompts(tok), PARAMS))
        port = proc.port
        proc.kill()
        proc = ServerProcess(workspace[0], port=port)  # a new process (weights as loaded) on the same port
        again = remote.generate(_prompts(tok), PARAMS)  # notices the restart, re-pushes version 1, retries
        assert _flat(again) == first and {c.version for g in again for c in g} == {1}
        assert _get(proc, "/health")["pushed"] is True
        proc.kill()
        proc = ServerProcess(workspace[0], port=port)  # restarted again, now before a push
        remote.sync_weights()  # the push finds the new server and sends version 2 there
        assert {c.version for g in remote.generate(_prompts(tok), PARAMS) for c in g} == {2}
    finally:
        proc.kill()


def _get(server, path: str) -> dict:
    req = urllib.request.Request(f"http://{server.address}{path}", headers=server.headers)  # the server's key
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{server.address}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers=server.headers)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _post_error(server, path: str, body: dict) -> tuple[int, dict]:
    try:
        _post(server, path, body)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    raise AssertionError("expected an error")


def test_concurrent_requests_decode_as_one_batch_with_their_own_draws(workspace):
    """In process: three requests at once (a data-parallel trainer's ranks) run as ONE engine batch and each
    gets what it gets alone, with the version it was served with."""
    import threading

    from cohort.serving.engine_server import EngineServer, Replica

    model, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    engine = _local(model, tok)
    server = EngineServer([Replica(model, engine, torch.device("cpu"), threading.Lock())], tok, model_name="m")
    server._coalescer.window_s = 0.3  # long enough for the three threads to queue
    requests = [(_prompts(tok)[:2], PARAMS), (_prompts(tok)[2:], SamplingParams(n=2, max_tokens=8, seed=9)),
                (_prompts(tok)[::-1], SamplingParams(n=1, max_tokens=10, temperature=0.7, seed=1))]
    alone = [engine.generate(p, q) for p, q in requests]
    calls, original = [], engine.generate
    engine.generate = lambda prompts, params: calls.append(len(prompts)) or original(prompts, params)
    results = run_at_once([functools.partial(server.generate, *request) for request in requests], timeout_s=30)
    assert calls == [6]  # 2 + 1 + 3 prompts in one generate
    for k in range(len(requests)):
        groups, version = results[k]
        assert version == 0 and _same(groups, alone[k])


def test_the_version_switch_waits_for_requests_in_flight(workspace):
    """In process: a commit that arrives mid-generation waits for it (the request finishes on the old weights,
    reported as the old version); the next request sees the new weights whole."""
    import threading

    from cohort.remote.weights import model_tensors
    from cohort.serving.engine_server import EngineServer, Replica, _Push

    model, tok = load_policy(str(workspace[0]), dtype=torch.float32)
    engine = _local(model, tok)
    server = EngineServer([Replica(model, engine, torch.device("cpu"), threading.Lock())], tok, model_name="m")
    old = engine.generate(_prompts(tok), PARAMS)
    other = tiny_model(tok, seed=3)
    new = _local(other, tok).generate(_prompts(tok), PARAMS)
    started, go, original = threading.Event(), threading.Event(), engine.generate

    def slow_generate(prompts, params):
        started.set()
        assert go.wait(10)  # held until the commit is queued behind this request
        return original(prompts, params)

    engine.generate = slow_generate
    results = []
    request = threading.Thread(target=lambda: results.append(server.generate(_prompts(tok), PARAMS)))
    request.start()
    assert started.wait(10)
    done = threading.Thread(target=lambda: None)
    done.start()
    done.join()
    staged = {n: t.detach().clone() for n, t in model_tensors(other)}
    server._push = _Push(version=1, specs=server.specs, thread=done, staged=staged)
    switched = []
    commit = threading.Thread(target=lambda: switched.append(server.weights_commit(1)))
    commit.start()
    deadline = time.monotonic() + 10
    while server._lock._writers_waiting == 0 and time.monotonic() < deadline:  # the switch waits for the request
        time.sleep(0.01)
    assert server._lock._writers_waiting == 1 and server.version == 0
    go.set()
    request.join(10)
    commit.join(10)
    (groups, version), = results
    assert version == 0 and _flat(groups) == _flat(old)  # all of it from the old weights
    assert switched[0]["version"] == 1
    engine.generate = original
    groups, version = server.generate(_prompts(tok), PARAMS)
    assert version == 1 and _flat(groups) == _flat(new)

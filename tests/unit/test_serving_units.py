"""Pure parts of cohort.serving: bucket plans, manifest checks, staleness, the readers-writer lock, addresses,
OpenAI request parsing, and the TRL facade's server mode."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cohort.errors import CohortError, ConfigError
from cohort.remote.client import parse_address
from cohort.remote.pipeline import staleness_metrics
from cohort.remote.weights import (
    TensorSpec,
    WeightMismatchError,
    check_manifest,
    check_plan,
    manifest_of,
    plan_buckets,
)
from cohort.serving import auth, limits, openai_api
from cohort.serving.engine_server import RWLock


def _spec(name, shape, dtype="float32"):
    return TensorSpec(name, tuple(shape), dtype)


def test_buckets_hold_consecutive_tensors_of_one_dtype_up_to_the_size():
    specs = [_spec("a", [4]), _spec("b", [4]), _spec("c", [2], "bfloat16"), _spec("d", [2], "bfloat16"),
             _spec("e", [100]), _spec("f", [1])]
    # bytes: a 16, b 16, c 4, d 4, e 400 (alone: larger than a bucket), f 4
    assert plan_buckets(specs, 32) == [[0, 1], [2, 3], [4], [5]]
    assert plan_buckets(specs, 1 << 20) == [[0, 1], [2, 3], [4, 5]]
    check_plan(plan_buckets(specs, 32), len(specs))
    with pytest.raises(WeightMismatchError, match="once, in order"):
        check_plan([[1, 0]], 2)


def test_manifest_mismatches_are_named():
    served = manifest_of([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    check_manifest(served, served)
    with pytest.raises(WeightMismatchError) as err:
        check_manifest(manifest_of([("w", torch.zeros(3, 2)), ("extra", torch.zeros(1))]), served)
    text = str(err.value)
    assert "'w' has shape [3, 2] in the push but [2, 3] on the server" in text
    assert "['extra']" in text and "['b']" in text
    with pytest.raises(WeightMismatchError, match="'b' is bfloat16 in the push but float32"):
        check_manifest(manifest_of([("w", torch.zeros(2, 3)), ("b", torch.zeros(3, dtype=torch.bfloat16))]), served)


def test_staleness_counts_versions_behind_the_trained_one():
    # trained from version 5: completions of 5, 4, 4 and 3 are 0, 1, 1 and 2 behind
    assert staleness_metrics([5, 4, 4, 3], current=5) == {"staleness/mean": 1.0, "staleness/max": 2.0}
    assert staleness_metrics([None, None], current=2) == {}


def test_rwlock_commit_waits_for_readers_and_blocks_new_ones():
    lock, events = RWLock(), []
    lock.acquire_read()

    def writer():
        lock.acquire_write()
        events.append("write")
        time.sleep(0.05)
        lock.release_write()

    def late_reader():
        lock.acquire_read()
        events.append("late read")
        lock.release_read()

    w = threading.Thread(target=writer)
    w.start()
    deadline = time.monotonic() + 5
    while lock._writers_waiting == 0 and time.monotonic() < deadline:  # the writer is queued
        time.sleep(0.01)
    r = threading.Thread(target=late_reader)
    r.start()
    time.sleep(0.05)
    assert events == []  # the writer waits for the first reader; the late reader waits behind the writer
    lock.release_read()
    w.join(2)
    r.join(2)
    assert events == ["write", "late read"]


def test_addresses():
    assert parse_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_address("http://gpu-box:9000/") == ("gpu-box", 9000)
    with pytest.raises(ConfigError, match="host:port"):
        parse_address("localhost")


class _Tok:
    chat_template = "x"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(m["content"] for m in messages) + ">"


def test_openai_requests_become_token_ids_and_sampling_params():
    ids, params = openai_api.completion_request({"prompt": "ab", "max_tokens": 3, "stop": "\n", "seed": 4}, _Tok(), "m")
    assert ids == [[97, 98]] and params.max_tokens == 3 and params.stop_strings == ("\n",) and params.seed == 4
    ids, _ = openai_api.completion_request({"prompt": [[1, 2], [3]]}, _Tok(), "m")
    assert ids == [[1, 2], [3]]
    ids, params = openai_api.chat_request({"messages": [{"role": "user", "content": "hi"}], "n": 2}, _Tok(), "m")
    assert ids == [[104, 105, 62]] and params.n == 2 and params.max_tokens == 256
    with pytest.raises(openai_api.RequestError, match="does not exist") as err:
        openai_api.completion_request({"model": "other", "prompt": "x"}, _Tok(), "m")
    assert err.value.status == 404
    with pytest.raises(openai_api.RequestError, match="unknown field"):
        openai_api.completion_request({"prompt": "x", "tempreature": 1}, _Tok(), "m")


def test_the_api_key_comes_from_the_flag_the_environment_or_is_drawn_and_is_checked_as_a_bearer_token():
    assert auth.resolve_key("k" * 20, {"COHORT_API_KEY": "other"}) == ("k" * 20, "--api-key")
    assert auth.resolve_key(None, {"COHORT_API_KEY": "e" * 20}) == ("e" * 20, "COHORT_API_KEY")
    key, source = auth.resolve_key(None, {})
    assert source == "generated" and len(key) >= 32 and key != auth.resolve_key(None, {})[0]
    assert auth.resolve_key("none", {"COHORT_API_KEY": "x"}) == (None, "off")  # only said on the command line
    with pytest.raises(CohortError, match="--api-key none"):
        auth.resolve_key(None, {"COHORT_API_KEY": "none"})
    assert auth.refusal(f"Bearer {key}", key) is None and auth.refusal(f"bearer  {key} ", key) is None
    assert auth.refusal(None, key) == "no Authorization header"
    assert auth.refusal(f"Basic {key}", key) and auth.refusal(f"Bearer {key}x", key) == "wrong API key"
    assert auth.refusal(None, None) is None  # --api-key none


def test_sampling_fields_are_range_checked_naming_the_field_the_value_and_the_fix():
    lim = limits.Limits(vocab_size=100, context=64)
    params = limits.sampling_params({"temperature": 0, "top_p": 1, "seed": None, "stop_token_ids": [99], "n": 2.0},
                                    lim)
    assert (params.temperature, params.stop_token_ids, params.n) == (0.0, (99,), 2)
    for field, value in [("temperature", float("nan")), ("temperature", float("inf")), ("top_p", 0.0),
                         ("min_p", 1.5), ("repetition_penalty", 0), ("max_tokens", 65), ("top_k", -1),
                         ("stop_token_ids", [100]), ("n", True), ("seed", -1), ("stop_strings", [""])]:
        with pytest.raises(limits.RequestError) as err:
            limits.sampling_params({field: value}, lim)
        assert err.value.param.startswith(f"params.{field}") and "send" in str(err.value), (field, err.value)
    assert limits.wait_seconds(1e9, lim) == lim.max_wait_s  # a long wait is cut, not refused
    with pytest.raises(limits.RequestError, match="wait_s=nan"):
        limits.wait_seconds(float("nan"), lim)
    with pytest.raises(limits.RequestError, match="64"):  # prompt + max_tokens beyond the context
        limits.check_room([[1] * 60], [limits.sampling_params({"max_tokens": 10}, lim)], lim)


def test_trl_server_mode_maps_to_server_placement():
    from cohort.trl_compat.config import GRPOConfig

    common = {"output_dir": "/tmp/x", "max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 8}
    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_port=8123, vllm_server_timeout=30.0,
                     **common).to_cohort()
    assert (cfg.generation.placement, cfg.generation.server_address) == ("server", "127.0.0.1:8123")
    assert cfg.generation.server_connect_timeout_s == 30.0
    cfg = GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://10.0.0.2:9000", **common)
    assert cfg.to_cohort().generation.server_address == "10.0.0.2:9000"
    assert GRPOConfig(use_vllm=True, **common).to_cohort().generation.placement == "colocate"
    with pytest.raises(ConfigError, match="vllm_mode"):
        GRPOConfig(use_vllm=True, vllm_mode="remote", **common).to_cohort()


class _Client:
    """A stand-in ServerClient whose /health answers while `alive` is set."""

    where = "cohort server at 10.0.0.1:8123"

    def __init__(self) -> None:
        self.alive = threading.Event()
        self.alive.set()
        self.probes = 0

    def request(self, method, path, body=None, *, phase, timeout_s=None):
        from cohort.remote.client import ServerUnavailable

        self.probes += 1
        if not self.alive.is_set():
            raise ServerUnavailable(f"{self.where} did not answer during {phase}: [Errno 111] Connection refused")
        return {"status": "ok"}


def test_a_watched_push_returns_its_result_or_its_error_and_names_a_server_gone_silent():
    from cohort.remote.client import ServerUnavailable
    from cohort.remote.liveness import run_watched

    client = _Client()
    assert run_watched(lambda cancelled: 7, client, phase="weight push", timeout_s=1.0, poll_s=0.05) == 7

    def failing(cancelled):
        raise RuntimeError("bucket 3 failed")

    with pytest.raises(RuntimeError, match="bucket 3"):
        run_watched(failing, client, phase="weight push", timeout_s=1.0, poll_s=0.05)
    slow_but_answering = run_watched(lambda c: time.sleep(0.6) or "done", client, phase="weight push",
                                     timeout_s=0.3, poll_s=0.05)
    assert slow_but_answering == "done"  # a long push is fine while the server answers /health
    client.alive.clear()
    aborted, seen = [], {}

    def stuck(cancelled):
        seen["cancelled"] = cancelled
        cancelled.wait(10)

    with pytest.raises(ServerUnavailable) as err:
        run_watched(stuck, client, phase="weight push", timeout_s=0.3, poll_s=0.05, abort=lambda: aborted.append(1))
    assert "liveness_timeout_s=0.3" in str(err.value)  # the 0.3 s watch ended it, not the stuck work's 10 s
    assert "10.0.0.1:8123" in str(err.value) and "stopped answering during weight push" in str(err.value)
    assert "Connection refused" in str(err.value) and aborted == [1] and seen["cancelled"].is_set()


def test_the_liveness_timeout_must_be_positive():
    from cohort.config import CohortConfig

    cfg = CohortConfig()
    cfg.generation.server_liveness_timeout_s = 0
    with pytest.raises(ConfigError, match="server_liveness_timeout_s"):
        cfg.validate()


def test_the_cli_leaves_with_exit_75_and_no_teardown_after_an_aborted_nccl_group(monkeypatch, capsys):
    """A server frozen mid-push: the NCCL group was aborted and the error raised, but the interpreter's teardown
    can wait forever on that communicator (measured on 2 H100s), so the CLI prints the error and os._exit(75)s."""
    from cohort import cli
    from cohort.remote import liveness
    from cohort.remote.client import ServerUnavailable

    def lost(args):
        raise ServerUnavailable("cohort server at 127.0.0.1:1 stopped answering during weight push")

    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code))
    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(parser, "parse_args", lambda argv: type("A", (), {"func": staticmethod(lost)})())
    assert cli.main(["train"]) == 2 and exits == []  # no group aborted: the ordinary error exit
    monkeypatch.setattr(liveness, "_NCCL_ABORTED", threading.Event())
    liveness.mark_nccl_aborted()
    cli.main(["train"])
    assert exits == [liveness.EXIT_SERVER_LOST]
    assert "during weight push" in capsys.readouterr().err

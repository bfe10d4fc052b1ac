"""`cohort serve`'s authentication and request limits (issue 35), on the CPU at 127.0.0.1.

Without the key nothing is served and nothing is pushed: every route answers 401 (one log line each, the key
never logged), a trainer without the key cannot push (the served greedy tokens stay what they were), and the
weight group's rendezvous listens on the HTTP host only. Every request field is range-checked: a NaN wait is
refused at once instead of spinning a thread, each bad sampling field is a 400 naming it, token ids outside the
vocabulary are a 400 instead of a 500, a bad Content-Length is refused before any body is read, and a burst of
500 concurrent clients is answered (200, or 503 with Retry-After from a full pool), never reset."""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler

import pytest
import torch
from tests.helpers.serving import ServerProcess
from tests.helpers.threads import run_at_once
from tests.helpers.toy_task import tiny_model, write_toy_workspace
from transformers import AutoConfig

from cohort.engine import CohortEngine
from cohort.policy.model import load_policy
from cohort.remote.errors import ServerAuthError
from cohort.serving import RemoteEngine
from cohort.serving.httpd import PooledHTTPServer
from cohort.setup.engine import eos_ids
from cohort.types import SamplingParams

GREEDY = SamplingParams(n=1, max_tokens=12, temperature=0.0)
TEXTS = ("Say the digit 3", "What is 2 + 3?")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    model_dir, _ = write_toy_workspace(tmp_path_factory.mktemp("serve_security"))
    return model_dir


@pytest.fixture(scope="module")
def server(workspace):
    proc = ServerProcess(workspace)  # the session's key (tests/helpers/serving.py), default limits
    yield proc
    proc.kill()


def _call(server, method: str, path: str, body: dict | None = None, *, key: str | None = None,
          text: str | None = None, timeout_s: float = 10.0) -> tuple[int, dict, dict]:
    """(status, JSON answer, headers); `key` None sends the server's key, "" none; `text`: the raw body."""
    key = server.api_key if key is None else key
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = text.encode() if text is not None else None if body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout_s)
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}"), dict(resp.getheaders())
    finally:
        conn.close()


def _raw(server, head: str, body: bytes = b"", timeout_s: float = 10.0) -> tuple[int, dict, float]:
    """Send a hand-written request head (and part of a body); (status, JSON answer, seconds to the answer)."""
    started = time.monotonic()
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read() or b"{}"), time.monotonic() - started


def _tokens(groups) -> list[tuple[list[int], list[float]]]:
    """Tokens and their logprobs (a tiny random model's greedy tokens repeat; its logprobs tell weights apart)."""
    return [(c.token_ids, [round(lp, 4) for lp in c.logprobs]) for g in groups for c in g]


def _log_lines(server, marker: str, expected: int, timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in list(server.log) if marker in line]
        if len(lines) >= expected or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_a_push_without_the_key_is_refused_and_the_served_tokens_stay(server, workspace, monkeypatch):
    _, tok = load_policy(str(workspace), dtype=torch.float32)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    reader = RemoteEngine(server.address)  # authenticated (COHORT_API_KEY), reads only
    before, health = _tokens(reader.generate(prompts, GREEDY)), server.get("/health")
    attacker = tiny_model(tok, seed=7)  # weights that would change the greedy tokens, were they served
    assert _tokens(CohortEngine(attacker, tok, eos_token_ids=eos_ids(tok, attacker)).generate(prompts, GREEDY)) \
        != before
    with monkeypatch.context() as env:  # the trainer's own client without the key, then with another one
        env.delenv("COHORT_API_KEY")
        with pytest.raises(ServerAuthError) as err:
            RemoteEngine(server.address, attacker, connect_timeout_s=2.0)
        assert "HTTP 401" in str(err.value) and "sent no key" in str(err.value), err.value
        env.setenv("COHORT_API_KEY", f"wrong-{server.api_key}")
        with pytest.raises(ServerAuthError) as err:
            RemoteEngine(server.address, attacker, connect_timeout_s=2.0)
    with pytest.raises(ServerAuthError) as err:  # api_key= wins over the environment
        RemoteEngine(server.address, attacker, connect_timeout_s=2.0, api_key="wrong")
    assert "HTTP 401" in str(err.value) and "COHORT_API_KEY" in str(err.value), err.value
    for path, body in (("/weights/init", {}), ("/weights/begin", {"version": 5, "manifest": [], "plan": []}),
                       ("/weights/commit", {"version": 5})):  # and the weight routes called directly
        status, answer, _ = _call(server, "POST", path, body, key="")
        assert status == 401 and answer["error"]["type"] == "authentication_error", (path, answer)
    assert _tokens(reader.generate(prompts, GREEDY)) == before
    after = server.get("/health")
    assert (after["version"], after["pushed"], after["session"]) == (health["version"], health["pushed"],
                                                                      health["session"])


def test_every_route_answers_401_without_the_right_key_with_one_log_line_each(server):
    wrong = f"not-the-key-{uuid.uuid4().hex}"
    routes = [("GET", "/health"), ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/no/such/route"),
              ("POST", "/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/weights/init"), ("POST", "/weights/begin"), ("POST", "/weights/commit"),
              ("POST", "/sessions/close"), ("POST", "/sessions/keepalive"), ("POST", "/sessions/wait")]
    probe = uuid.uuid4().hex
    for method, path in routes:
        for key in ("", wrong):
            body = {"prompts": [[1, 2]], "prompt": "x"} if method == "POST" else None
            status, answer, headers = _call(server, method, f"{path}?probe={probe}", body, key=key)
            assert status == 401, (method, path, key, status, answer)
            assert answer["error"]["code"] == "invalid_api_key" and "Bearer" in answer["error"]["message"]
            assert headers.get("WWW-Authenticate", "").startswith("Bearer")
    status, _, _ = _call(server, "GET", "/health", key="")  # a scheme other than Bearer is no key either
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    conn.request("GET", "/health", headers={"Authorization": f"Basic {server.api_key}"})
    assert status == 401 and conn.getresponse().status == 401
    conn.close()
    assert _call(server, "GET", "/health")[0] == 200  # the right key
    lines = _log_lines(server, probe, 2 * len(routes))
    assert len(lines) == 2 * len(routes), lines  # one line per refused request
    assert all("401" in line for line in lines)
    assert wrong not in "".join(server.log) and server.api_key not in "".join(server.log)


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 reaches this machine on Linux")
def test_the_weight_group_rendezvous_listens_on_the_http_host_only(server):
    status, first, _ = _call(server, "POST", "/weights/init", {})
    assert status == 200
    status, second, _ = _call(server, "POST", "/weights/init", {})  # a reconnecting trainer: a new group
    port = second["port"]
    with socket.create_connection(("127.0.0.1", port), timeout=5):  # the HTTP host: open
        pass
    with pytest.raises(ConnectionRefusedError):  # another address of this machine: nothing listens there
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    # the group's keys sit under a prefix drawn per group, told only to the authenticated caller
    assert first["prefix"] != second["prefix"] and len(second["prefix"]) > len("cohort-weights/") + 16


@pytest.mark.parametrize("wait", ["NaN", "Infinity", "-Infinity", "-1", "\"5\""])
def test_a_wait_that_is_not_a_finite_positive_number_is_refused_at_once(server, wait):
    body = ('{"prompts": [[1, 2]], "params": {"max_tokens": 1}, "min_version": 99, "session": "run", '
            f'"wait_s": {wait}}}')
    # refused at once: min_version 99 never comes, so a server that waited instead would let the client time out
    status, answer, _ = _call(server, "POST", "/generate", text=body, timeout_s=30.0)
    assert status == 400 and answer["error"]["param"] == "wait_s", answer
    assert "wait_s" in answer["error"]["message"] and "finite" in answer["error"]["message"]
    assert _call(server, "GET", "/health")[0] == 200  # and the server is still there


BAD_FIELDS = [("temperature", "-1"), ("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
              ("top_p", "0"), ("top_p", "1.5"), ("top_k", "-1"), ("top_k", "2.5"), ("min_p", "-0.5"),
              ("min_p", "1.5"), ("repetition_penalty", "0"), ("repetition_penalty", "NaN"), ("max_tokens", "0"),
              ("max_tokens", "100000"), ("n", "0"), ("n", "100000"), ("seed", "-3"), ("stop_token_ids", "[100000]"),
              ("ignore_eos", "\"yes\"")]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v}" for f, v in BAD_FIELDS])
def test_each_out_of_range_sampling_field_is_a_400_naming_it(server, field, value):
    generate = f'{{"prompts": [[5, 6]], "params": {{"max_tokens": 2, "{field}": {value}}}}}'
    completions = f'{{"prompt": [5, 6], "max_tokens": 2, "{field}": {value}}}'
    for path, body, name in (("/generate", generate, f"params.{field}"), ("/v1/completions", completions, field)):
        status, answer, _ = _call(server, "POST", path, text=body)
        assert status == 400, (path, status, answer)
        error = answer["error"]
        assert error["param"] == name and error["message"].startswith(name) and "send" in error["message"], error
        assert value.strip('"[]').lower().removesuffix("inity") in error["message"].lower(), error  # the value


def test_strings_and_counts_are_bounded(server):
    cases = [("/generate", {"prompts": [[5]], "params": {"max_tokens": 2, "stop_strings": ["x" * 5000]}}, "params.stop_strings[0]"),
             ("/v1/completions", {"prompt": "x", "stop": ["y"] * 100}, "stop"),
             ("/v1/completions", {"prompt": "x" * 300000}, "prompt[0]"),
             ("/generate", {"prompts": [[5]] * 70000}, "prompts"),
             ("/generate", {"prompts": [[5]], "params": {"max_tokens": 2}, "session": "s" * 1000}, "session"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -2},
              "temperature")]
    for path, body, param in cases:
        status, answer, _ = _call(server, "POST", path, body)
        assert status == 400 and answer["error"]["param"] == param, (path, param, answer)


def test_token_ids_outside_the_vocabulary_and_prompts_beyond_the_context_are_a_400(server, workspace):
    config = AutoConfig.from_pretrained(workspace)
    vocab, context = config.vocab_size, config.max_position_embeddings
    for prompts, param in (([[5, vocab]], "prompts[0]"), ([[5], [-1]], "prompts[1]"), ([[5, 1.5]], "prompts[0]"),
                           ([[True]], "prompts[0]"), ([[]], "prompts[0]"), ([[5] * context], "prompts[0]")):
        status, answer, _ = _call(server, "POST", "/generate", {"prompts": prompts, "params": {"max_tokens": 2}})
        assert status == 400 and answer["error"]["param"] == param, (prompts, answer)
    status, answer, _ = _call(server, "POST", "/generate", {"prompts": [[5] * (context - 4)],
                                                            "params": {"max_tokens": 10}})
    assert status == 400 and str(context) in answer["error"]["message"], answer  # prompt + max_tokens > context
    status, answer, _ = _call(server, "POST", "/v1/completions", {"prompt": [vocab + 3], "max_tokens": 2})
    assert status == 400 and answer["error"]["param"] == "prompt[0]", answer


def test_a_bad_content_length_is_refused_before_the_body_is_read(server):
    auth = f"Authorization: Bearer {server.api_key}\nHost: x\n"
    cases = [(f"POST /generate HTTP/1.1\n{auth}Content-Length: 100000000000\n\n", b"", 413),
             (f"POST /generate HTTP/1.1\n{auth}Content-Length: -1\n\n", b"", 400),
             (f"POST /generate HTTP/1.1\n{auth}Content-Length: 12abc\n\n", b"", 400),
             (f"POST /generate HTTP/1.1\n{auth}\n", b"", 411),
             (f"POST /generate HTTP/1.1\n{auth}Transfer-Encoding: chunked\n\n", b"5\r\n{}{}{\r\n", 411),
             # over the 16 MiB cap: answered once the head is in, while most of the body is still to come
             (f"POST /generate HTTP/1.1\n{auth}Content-Length: {17 << 20}\n\n", b"[" * (1 << 20), 413)]
    for head, body, expected in cases:
        # a server that waited for the body it refuses would leave the socket silent: _raw's timeout fails it
        status, answer, _ = _raw(server, head, body, timeout_s=30.0)
        assert status == expected and answer["error"]["type"] == "invalid_request_error", (head, status, answer)
    status, answer, _ = _raw(server, f"POST /generate HTTP/1.1\n{auth}Content-Length: 4\n\n", b"[[[[")  # no JSON
    assert status == 400 and "JSON" in answer["error"]["message"]


def test_500_concurrent_clients_are_all_answered_none_reset(server):
    def one() -> int | str:
        try:
            return _call(server, "GET", "/version", timeout_s=30.0)[0]
        except Exception as exc:  # a reset or a timeout: what the old listen backlog of 5 gave
            return type(exc).__name__

    results = run_at_once([one] * 500, timeout_s=60)  # fails if any client is still waiting after 60 s
    assert set(results) <= {200, 503}, {r: results.count(r) for r in set(results)}
    assert results.count(200) > 0


class _Slow(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        time.sleep(0.3)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format, *args) -> None:
        pass


def test_a_full_pool_answers_503_with_retry_after_instead_of_resetting():
    pool = PooledHTTPServer(("127.0.0.1", 0), _Slow, workers=2, queued=2)
    thread = threading.Thread(target=pool.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    host, port = pool.server_address[:2]

    def one() -> tuple[int, str | None, bytes] | str:
        try:
            conn = http.client.HTTPConnection(str(host), int(port), timeout=10)
            conn.request("GET", "/")
            resp = conn.getresponse()
            return resp.status, resp.getheader("Retry-After"), resp.read()
        except Exception as exc:
            return type(exc).__name__

    try:
        results = run_at_once([one] * 40, timeout_s=30)
    finally:
        pool.shutdown()
        pool.server_close()
    assert all(isinstance(r, tuple) for r in results), results  # every client answered, none reset
    statuses = [r[0] for r in results]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
    for status, retry_after, body in results:
        if status == 503:
            assert retry_after == "1" and json.loads(body)["error"]["type"] == "server_busy"


def test_a_generated_key_is_printed_and_none_turns_authentication_off_with_a_warning(workspace):
    generated = ServerProcess(workspace, api_key=None)  # no COHORT_API_KEY, no --api-key: one is drawn
    try:
        assert generated.api_key and len(generated.api_key) >= 32
        assert generated.get("/health")["status"] == "ok"
        assert _call(generated, "GET", "/health", key="")[0] == 401
    finally:
        generated.kill()
    open_server = ServerProcess(workspace, "--api-key", "none", api_key=None)
    try:
        assert _call(open_server, "GET", "/health", key="")[0] == 200
        assert "WARNING: authentication is OFF" in "".join(_log_lines(open_server, "WARNING", 1))
    finally:
        open_server.kill()

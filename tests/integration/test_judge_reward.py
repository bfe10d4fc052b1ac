"""The `judge` reward against a fake OpenAI-compatible endpoint (http.server on 127.0.0.1, in a thread) that
returns canned answers: scores parsed, requests concurrent, the API key sent, timeouts retried, malformed
answers named; and through the registry and the RewardRunner with both on_error modes."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import cohort.rewards.judge as judge_module
from cohort.rewards import RewardError, RewardRunner, get_reward_function
from cohort.rewards.judge import JudgeError, JudgeReward, chat_url


class FakeJudge:
    """What the server does: `answer(user_message) -> (status, text or None, delay_s)`; records every request."""

    def __init__(self, answer: Callable[[str], tuple[int, str | None, float]]):
        self.answer = answer
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[str], tuple[int, str | None, float]]], tuple[str, FakeJudge]]]:
    servers: list[ThreadingHTTPServer] = []

    def start(answer):
        fake = FakeJudge(answer)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # http.server calls it by this name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    status, text, delay = fake.answer(body["messages"][-1]["content"])
                    time.sleep(delay)
                    payload = (json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})
                               if text is not None else "not json").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
                    pass
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", fake

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def canned(by_completion: dict[str, str], delay: float = 0.0):
    """Answer with the canned text of the completion named in the message (the template puts it there)."""
    def answer(message: str):
        for key, text in by_completion.items():
            if f"<<{key}>>" in message:
                return 200, text, delay
        return 200, "Score: 0", delay
    return answer


TEMPLATE = "Q: {prompt}\nGold: {answer}\nA: <<{completion}>>\nGrade it."


def test_scores_are_parsed_and_scaled(serve):
    url, fake = serve(canned({"a": "Reasoning.\nScore: 7", "b": "**Score:** 10", "c": "score = 2.5",
                              "d": "3", "e": "I'd say 9/10 at first.\nScore: 4"}))
    judge = JudgeReward(url, "judge-model", TEMPLATE)
    out = judge(prompts=["p"] * 5, completions=["a", "b", "c", "d", "e"], answer=["g"] * 5)
    assert out == [0.7, 1.0, 0.25, 0.3, 0.4]  # the last "Score:" match, or a bare number, divided by 10
    first = fake.requests[0]
    assert first["model"] == "judge-model" and first["temperature"] == 0.0
    assert {r["messages"][-1]["content"] for r in fake.requests} >= {"Q: p\nGold: g\nA: <<a>>\nGrade it."}
    # a [0, 1] judge
    unit = JudgeReward(url + "/v1", "m", TEMPLATE, max_score=1.0, score_regex=r"p=(\d(?:\.\d+)?)")
    fake.answer = canned({"x": "p=0.8", "y": "p=1"})
    assert unit(prompts=["p", "p"], completions=["x", "y"], answer=["g", "g"]) == [0.8, 1.0]


def test_requests_run_concurrently_within_the_bound(serve):
    # each answer waits until 4 requests are in at once: two waves of 4 pass; requests sent one after another
    # (or fewer than 4 at a time) break the barrier instead, and the judge sees HTTP 500s
    wave = threading.Barrier(4, timeout=30)
    passed: list[bool] = []

    def answer_in_waves(message):
        try:
            wave.wait()
        except threading.BrokenBarrierError:
            passed.append(False)
            return 500, "the wave never filled", 0.0
        passed.append(True)
        return 200, "Score: 0", 0.0

    url, fake = serve(answer_in_waves)
    judge = JudgeReward(url, "m", TEMPLATE, max_workers=4, timeout_s=60, max_retries=0)
    out = judge(prompts=["p"] * 8, completions=[f"c{i}" for i in range(8)], answer=["g"] * 8)
    assert out == [0.0] * 8
    assert passed == [True] * 8  # two full waves of 4
    assert fake.max_in_flight == 4  # bounded by max_workers, and used


def test_the_api_key_comes_from_the_environment(serve, monkeypatch):
    url, fake = serve(canned({}))
    JudgeReward(url, "m", TEMPLATE)(prompts=["p"], completions=["c"], answer=["g"])
    assert "Authorization" not in fake.headers[-1]
    monkeypatch.setenv("COHORT_JUDGE_API_KEY", "sekrit")
    JudgeReward(url, "m", TEMPLATE)(prompts=["p"], completions=["c"], answer=["g"])
    assert fake.headers[-1]["Authorization"] == "Bearer sekrit"
    monkeypatch.setenv("MY_KEY", "other")
    JudgeReward(url, "m", TEMPLATE, api_key_env="MY_KEY")(prompts=["p"], completions=["c"], answer=["g"])
    assert fake.headers[-1]["Authorization"] == "Bearer other"


def test_a_timeout_is_retried_then_succeeds(serve):
    calls = {"n": 0}

    def slow_first(message):
        calls["n"] += 1
        return 200, "Score: 6", 1.0 if calls["n"] == 1 else 0.0

    url, fake = serve(slow_first)
    judge = JudgeReward(url, "m", TEMPLATE, timeout_s=0.3, max_retries=2, backoff_s=0.01)
    assert judge(prompts=["p"], completions=["c"], answer=["g"]) == [0.6]
    assert len(fake.requests) == 2


def test_a_request_that_always_times_out_is_an_error_after_the_retries(serve, monkeypatch):
    url, fake = serve(lambda message: (200, "Score: 6", 1.0))
    backoffs: list[float] = []  # the judge's waits between tries (its module's `time.sleep`)
    monkeypatch.setattr(judge_module, "time", SimpleNamespace(sleep=lambda s: backoffs.append(s) or time.sleep(s)))
    judge = JudgeReward(url, "m", TEMPLATE, timeout_s=0.2, max_retries=2, backoff_s=0.05)
    with pytest.raises(JudgeError, match=r"sample 0 of 1: the judge request failed 3 times, last: timed out after 0\.2"):
        judge(prompts=["p"], completions=["c"], answer=["g"])
    assert len(fake.requests) == 3  # three tries, each cut at its time limit (the answer comes after 1 s)
    assert backoffs == [0.05, 0.1]  # and the backoffs of 0.05 and 0.1 s between them


def test_server_errors_are_retried_and_client_errors_are_not(serve):
    statuses = iter([503, 200])
    url, fake = serve(lambda message: (next(statuses), "Score: 5", 0.0))
    assert JudgeReward(url, "m", TEMPLATE, backoff_s=0.0)(prompts=["p"], completions=["c"], answer=["g"]) == [0.5]
    assert len(fake.requests) == 2
    url, fake = serve(lambda message: (401, "Score: 5", 0.0))
    with pytest.raises(JudgeError, match="HTTP 401"):
        JudgeReward(url, "m", TEMPLATE, backoff_s=0.0)(prompts=["p"], completions=["c"], answer=["g"])
    assert len(fake.requests) == 1


def test_a_malformed_answer_is_a_named_error(serve):
    long_answer = "I cannot grade this. " * 30
    url, _ = serve(canned({"ok": "Score: 8", "bad": long_answer, "big": "Score: 12"}))
    judge = JudgeReward(url, "m", TEMPLATE)
    with pytest.raises(JudgeError) as info:
        judge(prompts=["p"] * 2, completions=["ok", "bad"], answer=["g"] * 2)
    message = str(info.value)
    assert "sample 1 of 2" in message and "no score matching" in message
    assert "I cannot grade this." in message and "..." in message and len(message) < 600  # truncated
    with pytest.raises(JudgeError, match=r"the score 12 is outside \[0, 10\]"):
        judge(prompts=["p"], completions=["big"], answer=["g"])
    url, _ = serve(lambda message: (200, None, 0.0))  # not a chat completion at all
    with pytest.raises(JudgeError, match="not a chat completion: 'not json'"):
        JudgeReward(url, "m", TEMPLATE)(prompts=["p"], completions=["c"], answer=["g"])


def test_through_the_registry_and_the_runner_with_both_on_error_modes(serve):
    url, fake = serve(canned({"good": "Score: 9", "bad": "no idea"}))
    judge = get_reward_function("judge", base_url=url, model="m", template=TEMPLATE)
    assert isinstance(judge, JudgeReward)
    kwargs = {"prompts": ["p"] * 3, "completions": ["good", "bad", "good"], "completion_ids": [[1]] * 3,
              "columns": {"answer": ["g"] * 3}}
    result = RewardRunner([judge], on_error="skip")(**kwargs)
    values = result.rewards[:, 0].tolist()
    assert values[0] == pytest.approx(0.9) and values[2] == pytest.approx(0.9) and values[1] != values[1]  # NaN
    assert result.num_errors == {"judge": 1}
    assert len(fake.requests) == 3  # the runner's one-sample re-runs were answered from the last batch
    with pytest.raises(RewardError, match=r"'judge'.*no score matching.*'no idea'"):
        RewardRunner([judge], on_error="raise")(**kwargs)


def test_conversational_rows_and_template_placeholders(serve):
    url, fake = serve(canned({}))
    template = "{prompt} | {completion} | {answer} | {topic} | {{literal}}"
    judge = JudgeReward(url, "m", template, system_prompt="Be fair.")
    prompts = [[{"role": "system", "content": "sys"}, {"role": "user", "content": "What is 2+2?"}]]
    completions = [[{"role": "assistant", "content": "4"}]]
    judge(prompts=prompts, completions=completions, solution=["4"], topic=["math"])
    messages = fake.requests[-1]["messages"]
    assert messages[0] == {"role": "system", "content": "Be fair."}
    assert messages[1]["content"] == "What is 2+2? | 4 | 4 | math | {literal}"
    with pytest.raises(JudgeError, match=r"the template uses \['topic'\]"):
        judge(prompts=["p"], completions=["c"], answer=["g"])


def test_settings_are_checked():
    assert chat_url("http://h:1") == chat_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_url("https://x/api/chat/completions") == "https://x/api/chat/completions"
    for bad in [{"base_url": "h:1"}, {"max_score": 0}, {"max_workers": 0}, {"timeout_s": 0}, {"max_retries": -1},
                {"score_regex": "("}]:
        with pytest.raises(ValueError, match="judge"):
            JudgeReward(**{"base_url": "http://h:1", "model": "m", **bad})

"""Served conversations on kept KV (serving/sessions.py, remote/session_turns.py), on the CPU with a tiny model
served from a thread: the same tokens, logprobs and masks as the in-process multi-turn engine (and, greedy,
as the re-send path), only the new tokens prefilled at a later turn, sessions freed on close, keep=false,
timeout, a dead client and the cap (their blocks back in the pool), and an evicted session named (410) and
re-opened by the client with the whole conversation, also after a server restart (a subprocess).

The sessions' clock is a fake one the tests move (no wall-clock waits)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch
from tests.helpers.serving import ServerProcess
from tests.helpers.toy_task import tiny_model as toy_model
from tests.helpers.toy_task import write_toy_workspace
from tests.integration.engine_models import EOS, random_prompts, tiny_model

from cohort.engine import CohortEngine
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.errors import CohortError
from cohort.policy.model import load_policy
from cohort.remote.errors import ServerError, SessionGone
from cohort.serving import RemoteEngine
from cohort.serving.engine_server import EngineServer, Replica
from cohort.serving.server import make_http_server
from cohort.serving.sessions import SessionTable, attach, check_options
from cohort.setup.engine import eos_ids
from cohort.types import SamplingParams, TurnEnd

KEY = "test-key"
STOPS = tuple(range(3, 24))
CONTEXT = {1: [50, 51, 52, 53, 54], 2: [60, 61, 62]}  # what "the tools" append after turns 1 and 2


class _Tok:
    """What HFGenerateEngine needs of a tokenizer when no stop strings are used."""

    pad_token_id = 0
    eos_token_id = EOS


def scripted(turn: TurnEnd) -> list[int] | None:
    return CONTEXT.get(turn.turn)


def make_engine(model) -> CohortEngine:
    return CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=160)


@contextmanager
def served(model, *, cap: int = 8, timeout_s: float = 300.0):
    """(the served engine, its session table, its fake clock [now], a RemoteEngine); shut down after."""
    engine = make_engine(model)
    server = EngineServer([Replica(model=model, engine=engine, device=engine.device, lock=threading.Lock())],
                          None, model_name="tiny")
    now = [0.0]
    server.sessions = SessionTable(engine, server.replicas[0].lock, timeout_s=timeout_s, cap=cap,
                                   clock=lambda: now[0])
    http = make_http_server(server, "127.0.0.1", 0, api_key=KEY)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield engine, server.sessions, now, RemoteEngine(f"127.0.0.1:{http.server_address[1]}", api_key=KEY)
    finally:
        http.shutdown()
        http.server_close()


def _post(remote: RemoteEngine, path: str, body: dict) -> dict:
    return remote.client.request("POST", path, body, phase="test")


def _open(remote: RemoteEngine, sid: str, prompt: list[int], owner: str = "a", keep: bool = True) -> dict:
    params = {"n": 1, "max_tokens": 60, "temperature": 0.0, "stop_token_ids": list(STOPS)}
    return _post(remote, "/generate", {"prompts": [prompt], "params": params, "session_id": sid, "keep": keep,
                                       "owner": owner})


def _free(engine: CohortEngine) -> bool:
    return engine.blocks.num_used_blocks == 0 and not engine.scheduler.paused


def test_session_turns_equal_the_in_process_engine_and_prefill_only_new_tokens():
    model = tiny_model("llama")
    prompts = random_prompts([7, 12, 5])
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=80, stop_token_ids=STOPS, seed=4)
    in_process = make_engine(model)
    local = in_process.generate_turns(prompts, sampled, scripted)
    with served(model) as (engine, table, _, remote):
        assert remote.use_sessions and remote.session_groups  # the server announced both in /health
        before = engine.stats.prefill_tokens
        got = remote.generate_turns(prompts, sampled, scripted)
        prefilled = engine.stats.prefill_tokens - before
        flat, ref = [c for g in got for c in g], [c for g in local for c in g]
        assert [c.token_ids for c in flat] == [c.token_ids for c in ref]
        assert [c.mask for c in flat] == [c.mask for c in ref]
        assert [c.turns for c in flat] == [c.turns for c in ref]
        for c, r in zip(flat, ref):
            assert c.logprobs == pytest.approx(r.logprobs, abs=1e-5)
        assert any(c.turns == 3 for c in flat)  # the continued turns ran
        # each prompt once for its n conversations (they share its blocks, as in process), then per continued
        # turn its context and the turn's last sampled token: the in-process engine's prefill, token for token
        continued = sum(len(CONTEXT[t]) + 1 for c in flat for t in range(1, c.turns))
        assert prefilled == sum(map(len, prompts)) + continued == in_process.stats.prefill_tokens
        assert len(table) == 0 and _free(engine)  # the client closed its sessions at the end

        remote.session_groups = False  # a server without groups: a session per conversation, the same tokens
        before = engine.stats.prefill_tokens
        alone = remote.generate_turns(prompts, sampled, scripted)
        assert [c.token_ids for g in alone for c in g] == [c.token_ids for c in ref]
        assert engine.stats.prefill_tokens - before == sampled.n * sum(map(len, prompts)) + continued
        remote.session_groups = True

        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=80, stop_token_ids=STOPS)
        before = engine.stats.prefill_tokens
        kept = remote.generate_turns(prompts, greedy, scripted)
        kept_prefill = engine.stats.prefill_tokens - before
        remote.use_sessions = False  # today's re-send path: the same tokens, the whole conversation prefilled
        before = engine.stats.prefill_tokens
        resent = remote.generate_turns(prompts, greedy, scripted)
        assert [c.token_ids for g in kept for c in g] == [c.token_ids for g in resent for c in g]
        assert [c.mask for g in kept for c in g] == [c.mask for g in resent for c in g]
        assert engine.stats.prefill_tokens - before > kept_prefill


def test_sessions_are_freed_on_close_keep_false_timeout_dead_client_and_the_cap():
    model = tiny_model("llama")
    p = random_prompts([9])[0]
    with served(model, cap=2, timeout_s=10.0) as (engine, table, now, remote):
        assert _open(remote, "s1", p)["kept"] == [True] and len(table) == 1 and not _free(engine)
        assert _post(remote, "/sessions/close", {"session_ids": ["s1"]}) == {"closed": 1}
        assert len(table) == 0 and _free(engine)  # close

        assert _open(remote, "s2", p, keep=False)["kept"] == [False] and _free(engine)  # keep: false

        _open(remote, "dead", p, owner="gone")  # a client that never comes back
        now[0] = 6.0
        _open(remote, "alive", p, owner="here")
        now[0] = 9.0
        assert _post(remote, "/sessions/keepalive", {"owner": "here"}) == {"sessions": 1}
        now[0] = 17.0  # past both sessions' timeouts, not past the keepalive's
        with table.lock:
            assert table.sweep() == 1  # the dead client's session timed out; the live one was kept alive
        assert len(table) == 1
        now[0] = 30.0
        with table.lock:
            assert table.sweep() == 1
        assert len(table) == 0 and _free(engine)  # timeout

        for sid in ("c1", "c2", "c3"):  # the cap: the least recently used goes
            _open(remote, sid, p)
        assert len(table) == 2 and len(engine.scheduler.paused) == 2  # c1's blocks went back to the pool
        with pytest.raises(SessionGone, match="'c1' was ended"):
            _post(remote, "/generate", {"prompts": [[50]], "params": {"n": 1, "max_tokens": 60}, "session_id": "c1",
                                        "continue": True, "keep": True})
        assert _post(remote, "/sessions/close", {"owner": "a"}) == {"closed": 2}
        assert len(table) == 0 and _free(engine)

        def failing(turn: TurnEnd):
            raise RuntimeError("the tool crashed")

        with pytest.raises(RuntimeError, match="the tool crashed"):  # a client that fails closes its sessions
            remote.generate_turns([p], SamplingParams(n=2, temperature=0.0, max_tokens=60, stop_token_ids=STOPS),
                                  failing)
        assert len(table) == 0 and _free(engine)


def test_a_prompt_with_n_samples_opens_n_sessions_on_one_prefill_each_continued_alone():
    model = tiny_model("llama")
    p = random_prompts([9])[0]
    params = {"n": 2, "max_tokens": 60, "temperature": 1.0, "seed": 3, "stop_token_ids": list(STOPS)}
    group = {"prompts": [p], "params": params, "session_id": ["g0", "g1"], "keep": True, "owner": "a"}
    with served(model) as (engine, table, _, remote):
        for bad, named in (({"session_id": ["g0"]}, "one session_id per completion"),
                           ({"continue": True}, "`continue` request gives one session_id per prompt")):
            with pytest.raises(ServerError, match=named):
                _post(remote, "/generate", {**group, **bad})
        before = engine.stats.prefill_tokens
        out = _post(remote, "/generate", group)
        assert engine.stats.prefill_tokens - before == len(p) and out["kept"] == [True, True] and len(table) == 2
        local = make_engine(model).generate(  # a group's samples: seeds 3 and 4, as one prompt in process
            [p], SamplingParams(n=2, max_tokens=60, temperature=1.0, seed=3, stop_token_ids=STOPS))
        assert [c["token_ids"] for c in out["completions"][0]] == [c.token_ids for c in local[0]]
        for sid in ("g1", "g0"):  # each session goes on alone, on its own kept sequence
            more = _post(remote, "/generate", {"prompts": [[50, 51]], "params": {**params, "n": 1},
                                               "session_id": sid, "keep": False, "continue": True})
            assert more["completions"][0][0]["mask"].count(0) == 2
        assert len(table) == 0 and _free(engine)


def test_an_evicted_session_is_named_and_the_client_reopens_it_with_the_whole_conversation():
    model = tiny_model("llama")
    prompts = random_prompts([7, 12, 5])
    with served(model, cap=1) as (engine, table, _, remote):
        _open(remote, "first", prompts[0])
        _open(remote, "second", prompts[1])  # the cap of 1 evicts "first"
        body = {"prompts": [[50, 51]], "params": {"n": 1, "max_tokens": 60}, "session_id": "first",
                "continue": True, "keep": True}
        with pytest.raises(SessionGone, match="re-send the whole conversation"):
            _post(remote, "/generate", body)
        with pytest.raises(SessionGone, match="unknown"):
            _post(remote, "/generate", {**body, "session_id": "never-opened"})
        for bad, named in (("x" * 129, "129 characters"), (7, "must be a string or a non-empty list"), (["a", "a"], "distinct")):
            with pytest.raises(ServerError, match=named):  # a client-chosen id is checked as every field (400)
                _post(remote, "/generate", {**body, "session_id": bad, "continue": False})
        _post(remote, "/sessions/close", {"owner": "a"})
        # three conversations, one kept at a time: the client re-opens the evicted ones and gets the same tokens
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=80, stop_token_ids=STOPS)
        got = remote.generate_turns(prompts, greedy, scripted)
        ref = make_engine(model).generate_turns(prompts, greedy, scripted)
        assert [c.token_ids for g in got for c in g] == [c.token_ids for g in ref for c in g]
        assert [c.mask for g in got for c in g] == [c.mask for g in ref for c in g]
        assert [c.turns for g in got for c in g] == [c.turns for g in ref for c in g]
        assert len(table) == 0 and _free(engine)


def test_cohort_serve_attaches_sessions_to_its_engine_only_and_checks_the_flags():
    model = tiny_model("llama")
    engine = make_engine(model)
    server = EngineServer([Replica(model=model, engine=engine, device=engine.device, lock=threading.Lock())],
                          None, model_name="tiny")
    assert server.health()["sessions"] is False
    table = attach(server, 5.0, 3)
    assert table is server.sessions and server.health()["max_sessions"] == 3 and server.health()["sessions"]
    hf = HFGenerateEngine(model, _Tok(), eos_token_ids=[EOS])  # cannot keep a sequence: clients re-send
    other = EngineServer([Replica(model=model, engine=hf, device=engine.device, lock=threading.Lock())], None,
                         model_name="tiny")
    assert attach(other, 5.0, 3) is None and other.health()["sessions"] is False
    for timeout_s, cap, named in ((0.0, 3, "--session-timeout-s=0.0"), (float("nan"), 3, "--session-timeout-s"),
                                  (5.0, 0, "--max-sessions=0")):
        with pytest.raises(CohortError, match=named):
            check_options(timeout_s, cap)


def test_a_server_restarted_mid_conversation_is_re_pushed_and_the_conversation_re_opened(tmp_path):
    """`cohort serve` in a subprocess restarts between two turns: the continued round is refused (410, the new
    process holds no sessions), the client re-opens the conversations with their whole text, notices the new
    server, re-pushes its weights and samples again: greedy, the tokens are the in-process engine's."""
    model_dir, _ = write_toy_workspace(tmp_path)
    _, tok = load_policy(str(model_dir), dtype=torch.float32)
    policy = toy_model(tok, seed=11)
    procs = [ServerProcess(model_dir)]
    params = SamplingParams(n=2, max_tokens=24, temperature=0.0, stop_token_ids=tuple(range(len(tok))))  # 1-token turns
    prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3?")]

    def on_turn_end(turn: TurnEnd):
        if len(procs) == 1:  # at the first turn's end
            port = procs[-1].port
            procs[-1].kill()
            procs.append(ServerProcess(model_dir, port=port))  # a new process, weights as loaded
        return [5, 6, 7] if turn.turn < 3 else None

    try:
        remote = RemoteEngine(procs[0].address, policy, timeout_s=30.0)
        assert remote.use_sessions
        got = remote.generate_turns(prompts, params, on_turn_end)
        assert len(procs) == 2  # the restart happened mid-rollout
        ref = CohortEngine(policy, tok, eos_token_ids=eos_ids(tok, policy)).generate_turns(prompts, params,
                                                                                            on_turn_end_local)
        assert [c.token_ids for g in got for c in g] == [c.token_ids for g in ref for c in g]
        assert [c.mask for g in got for c in g] == [c.mask for g in ref for c in g]
        assert any(c.turns > 1 for g in got for c in g)
    finally:
        for proc in procs:
            proc.kill()


def on_turn_end_local(turn: TurnEnd):
    return [5, 6, 7] if turn.turn < 3 else None

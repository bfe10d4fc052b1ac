"""Served session turns are continuous (serving/session_driver.py, remote/session_turns.py), on the CPU with a
tiny model served from a thread: a conversation whose tool is slow does not hold back another conversation's
next turns (the order of the turns, as in process; the tokens equal the in-process engine's), a detached turn
is answered by /sessions/wait, a session in a turn refuses a second one, a close waits for a turn in flight and
frees it, the new fields are checked (400 naming them), and a server that dies mid-rollout is a named error.
No wall-clock assertion: the orders and answers are what is checked."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager

import pytest
from tests.integration.engine_models import VOCAB, random_prompts, tiny_model
from tests.integration.test_serving_sessions import CONTEXT, KEY, STOPS, make_engine

from cohort.remote.errors import ServerError, ServerUnavailable
from cohort.serving import RemoteEngine
from cohort.serving.engine_server import EngineServer, Replica
from cohort.serving.server import make_http_server
from cohort.serving.sessions import SessionTable
from cohort.types import SamplingParams, TurnEnd

ONE_TOKEN_TURNS = SamplingParams(n=2, temperature=0.0, max_tokens=40, stop_token_ids=tuple(range(VOCAB)))
FALLBACK_S = 10.0  # a lock-step client waits for the slow tool before any other turn: it is released then


@contextmanager
def serving(model, **remote_options):
    """(its EngineServer, session table, HTTP server, a RemoteEngine); shut down after."""
    engine = make_engine(model)
    server = EngineServer([Replica(model=model, engine=engine, device=engine.device, lock=threading.Lock())],
                          None, model_name="tiny")
    server.sessions = SessionTable(engine, server.replicas[0].lock)
    http = make_http_server(server, "127.0.0.1", 0, api_key=KEY)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield server, server.sessions, http, RemoteEngine(f"127.0.0.1:{http.server_address[1]}", api_key=KEY,
                                                          **remote_options)
    finally:
        http.shutdown()
        http.server_close()


class SlowToolForFirstConversation:
    """The tool of conversation (0, 0)'s first turn is slow: its result comes when conversation (0, 1) has
    ended its last turn (or, for a client that waits for it before any other turn, after FALLBACK_S)."""

    def __init__(self) -> None:
        self.turns: list[tuple[int, int]] = []  # (sample, turn) in the order the turns ended
        self.released_by: list[str] = []
        self.slow: Future = Future()
        self._timer = threading.Timer(FALLBACK_S, self.release, args=("the fallback timer",))
        self._timer.daemon = True

    def release(self, who: str) -> None:
        with contextlib.suppress(InvalidStateError):
            self.slow.set_result(CONTEXT[1])
            self.released_by.append(who)

    def __call__(self, turn: TurnEnd):
        self.turns.append((turn.sample_index, turn.turn))
        if (turn.sample_index, turn.turn) == (0, 1):
            self._timer.start()
            return self.slow
        if turn.turn >= 3:
            if turn.sample_index == 1:
                self.release("conversation 1's last turn")
            return None
        return CONTEXT[turn.turn]


def test_a_slow_tool_does_not_delay_another_conversations_next_turns():
    model = tiny_model("llama")
    prompt = random_prompts([9])[0]
    local_tool = SlowToolForFirstConversation()
    local = make_engine(model).generate_turns([prompt], ONE_TOKEN_TURNS, local_tool)
    with serving(model) as (_, table, _, remote):
        tool = SlowToolForFirstConversation()
        got = remote.generate_turns([prompt], ONE_TOKEN_TURNS, tool)
        # conversation 1 ran its second and third turns while conversation 0's tool was running, as in process
        assert tool.released_by == ["conversation 1's last turn"], tool.turns
        assert tool.turns.index((1, 3)) < tool.turns.index((0, 2))
        assert local_tool.released_by == tool.released_by and sorted(local_tool.turns) == sorted(tool.turns)
        assert [c.token_ids for c in got[0]] == [c.token_ids for c in local[0]]
        assert [c.mask for c in got[0]] == [c.mask for c in local[0]]
        assert [c.turns for c in got[0]] == [c.turns for c in local[0]] == [3, 3]
        assert len(table) == 0


def test_a_close_does_not_hold_back_the_other_conversations_turns():
    """Conversation 0 ends at its first turn, conversation 1 runs three. The server holds the close of
    conversation 0 until conversation 1's last turn has ended (or, for a client whose next turns wait for
    that close, FALLBACK_S): the client closes from its own thread, and the server's driver releases the
    closed sessions' blocks between its steps (a close never queues for the replica's lock)."""
    model = tiny_model("llama")
    prompt = random_prompts([9])[0]
    with serving(model) as (_, table, _, remote):
        close, release_kv = table.close, table.release_kv
        released, released_by, freed_on = threading.Event(), [], []

        def held_close(ids=None, owner=None):
            if ids is not None and not released.wait(FALLBACK_S):
                released_by.append("the fallback timer")
            return close(ids, owner)

        def recorded_release(seq):
            freed_on.append(threading.current_thread().name)
            release_kv(seq)

        def tool(turn: TurnEnd):
            if turn.sample_index == 0:
                return None  # ends: its session is closed
            if turn.turn >= 3:
                released_by.append("conversation 1's last turn")
                released.set()
                return None
            return CONTEXT[turn.turn]

        table.close, table.release_kv = held_close, recorded_release
        got = remote.generate_turns([prompt], ONE_TOKEN_TURNS, tool)
        assert released_by == ["conversation 1's last turn"]
        assert [c.turns for c in got[0]] == [1, 3] and len(table) == 0
        assert freed_on and set(freed_on) == {"cohort-session-turns"}  # the driver's thread, between steps


def _post(remote: RemoteEngine, path: str, body: dict) -> dict:
    return remote.client.request("POST", path, body, phase="test")


def _turn(sid: str, prompt: list[int], **fields) -> dict:
    params = {"n": 1, "max_tokens": 40, "temperature": 0.0, "stop_token_ids": list(STOPS)}
    return {"prompts": [prompt], "params": params, "session_id": sid, "keep": True, "owner": "o", **fields}


def test_a_detached_turn_is_answered_by_wait_and_a_close_waits_for_a_turn_in_flight():
    model = tiny_model("llama")
    prompt = random_prompts([7])[0]
    with serving(model) as (_, table, _, remote):
        engine = table.engine
        with table.lock:  # the engine is busy: the turns stay queued
            assert _post(remote, "/generate", _turn("s", prompt, detach=True))["accepted"] == 1
            with pytest.raises(ServerError, match="'s' is in a turn already"):
                _post(remote, "/generate", _turn("s", [50], detach=True, **{"continue": True}))
            assert len(table) == 1
        answers = _post(remote, "/sessions/wait", {"owner": "o", "timeout_s": 30})["turns"]
        assert [(a["session_id"], a["kept"], a["turns"], a["version"]) for a in answers] == [("s", True, 1, 0)]
        assert _post(remote, "/generate", _turn("s", [50, 51], detach=True, **{"continue": True}))["accepted"] == 1
        second = _post(remote, "/sessions/wait", {"owner": "o", "timeout_s": 30})["turns"][0]
        assert second["token_ids"][:len(answers[0]["token_ids"])] == answers[0]["token_ids"]
        assert second["mask"].count(0) == 2 and second["turns"] == 2

        with table.lock:  # a turn in flight of a closed owner ends with the close: freed, its answer dropped
            _post(remote, "/generate", _turn("t", prompt, detach=True))
            closed: list[dict] = []
            closer = threading.Thread(target=lambda: closed.append(_post(remote, "/sessions/close", {"owner": "o"})))
            closer.start()
            with table.cond:  # the close has marked the turn before the engine could run it
                assert table.cond.wait_for(lambda: table._busy["t"].closing, 60)
        closer.join(60)
        assert closed == [{"closed": 2}]  # "s" (idle) and "t" (in its turn)
        assert len(table) == 0 and engine.blocks.num_used_blocks == 0 and not engine.scheduler.paused
        assert _post(remote, "/sessions/wait", {"owner": "o", "timeout_s": 30})["turns"] == []  # at once: closed


def test_a_turn_is_answered_as_soon_as_it_ends_not_with_the_other_turns_of_its_request():
    """Two sessions opened in one detached request: a 1-token turn and a 150-token one. The long turn is held
    (its engine steps wait) until the short conversation's second turn was sent, which needs the first
    short turn's answer while the long one still runs."""
    model = tiny_model("llama")
    prompt = random_prompts([7])[0]
    short = {"n": 1, "max_tokens": 40, "temperature": 0.0, "stop_token_ids": list(range(VOCAB))}
    long = {"n": 1, "max_tokens": 150, "temperature": 0.0, "ignore_eos": True}
    with serving(model) as (_, table, _, remote):
        engine, step, sent, released_by = table.engine, table.engine.step, threading.Event(), []

        def held_step():
            turn = table._busy.get("long")
            if turn is not None and turn.seq is not None and turn.seq.num_completion_tokens >= 5 and not released_by:
                released_by.append("the short conversation's second turn" if sent.wait(FALLBACK_S) else "the timer")
                sent.set()
            return step()

        engine.step = held_step
        body = {"prompts": [prompt, prompt], "params": [short, long], "session_id": ["short", "long"], "keep": True,
                "detach": True, "owner": "o"}
        assert _post(remote, "/generate", body)["accepted"] == 2
        first = _post(remote, "/sessions/wait", {"owner": "o", "timeout_s": 30})["turns"]
        assert [a["session_id"] for a in first] == ["short"]  # answered while the long turn runs
        _post(remote, "/generate", _turn("short", [50], detach=True, **{"continue": True}))
        sent.set()
        order = []
        while len(order) < 2:
            order += [(a["session_id"], a["turns"]) for a in _post(remote, "/sessions/wait", {"owner": "o"})["turns"]]
        assert order == [("short", 2), ("long", 1)] and released_by == ["the short conversation's second turn"]


def test_the_new_session_fields_are_checked_by_name():
    model = tiny_model("llama")
    prompt = random_prompts([5])[0]
    with serving(model) as (_, table, _, remote):
        cases = [("/generate", _turn("a", prompt, detach="yes"), "detach"),
                 ("/generate", {**_turn("a", prompt, detach=True), "owner": None}, "owner"),
                 ("/generate", {"prompts": [prompt], "detach": True}, "need a `session_id`"),
                 ("/sessions/wait", {"timeout_s": 1}, "owner"),
                 ("/sessions/wait", {"owner": 7}, "owner"),
                 ("/sessions/wait", {"owner": "o", "timeout_s": -1}, "timeout_s"),
                 ("/sessions/wait", {"owner": "o", "timeout_s": "soon"}, "timeout_s"),
                 ("/sessions/wait", {"owner": "o", "timeout_s": True}, "timeout_s"),
                 ("/sessions/wait", {"owner": "o", "timeout_s": float("nan")}, "timeout_s"),
                 ("/sessions/wait", {"owner": "x" * 129}, "owner"),
                 ("/sessions/wait", {"owner": "o", "turns": 3}, "unknown field")]
        for path, body, named in cases:
            with pytest.raises(ServerError, match="HTTP 400") as err:
                _post(remote, path, body)
            assert named in str(err.value), (path, body, err.value)
        assert len(table) == 0


def test_a_server_that_dies_mid_rollout_is_a_named_error_not_a_hang():
    model = tiny_model("llama")
    prompt = random_prompts([7])[0]
    with serving(model, timeout_s=2.0, connect_timeout_s=1.0) as (_, _, http, remote):
        def kill_at_first_turn(turn: TurnEnd):
            if turn.turn == 1 and not stopped.is_set():
                stopped.set()
                http.shutdown()
                http.server_close()
            return CONTEXT.get(turn.turn)

        stopped = threading.Event()
        with pytest.raises(ServerUnavailable, match="did not answer"):
            remote.generate_turns([prompt], ONE_TOKEN_TURNS, kill_at_first_turn)
        assert stopped.is_set()


def test_an_engine_error_fails_the_turns_in_flight_by_name_and_the_engine_starts_clean():
    model = tiny_model("llama")
    prompts = random_prompts([7, 5])
    with serving(model) as (_, table, _, remote):
        engine, step = table.engine, table.engine.step

        def failing_step():
            engine.step = step  # once
            raise RuntimeError("the engine broke")

        engine.step = failing_step
        with pytest.raises(ServerError, match="failed a session turn: the engine broke"):
            remote.generate_turns(prompts, ONE_TOKEN_TURNS, SlowToolForFirstConversation())
        assert len(table) == 0 and engine.blocks.num_used_blocks == 0 and not engine.scheduler.has_work()
        got = remote.generate_turns(prompts, ONE_TOKEN_TURNS, lambda turn: CONTEXT.get(turn.turn))
        local = make_engine(model).generate_turns(prompts, ONE_TOKEN_TURNS, lambda turn: CONTEXT.get(turn.turn))
        assert [c.token_ids for g in got for c in g] == [c.token_ids for g in local for c in g]


def test_a_turn_queued_while_a_weight_commit_waits_runs_under_the_committed_version():
    """The driver holds the read lock while turns are in flight; a commit that waits for it lets the driver
    admit no new turn: the turn queued meanwhile starts after the commit, under its version (never half on
    the old weights, and no deadlock between the commit and the driver)."""
    model = tiny_model("llama")
    prompt = random_prompts([7])[0]
    with serving(model) as (server, table, _, remote):
        rw = server._lock
        committed = threading.Event()

        def commit() -> None:  # what /weights/commit does around its copy
            rw.acquire_write()
            server.version = 1
            rw.release_write()
            committed.set()

        with table.lock:  # the driver takes the version (read lock), then waits for the engine
            assert _post(remote, "/generate", _turn("q", prompt, detach=True))["accepted"] == 1
            with rw._cond:
                assert rw._cond.wait_for(lambda: rw._readers == 1, 60)
            writer = threading.Thread(target=commit)
            writer.start()
            with rw._cond:
                assert rw._cond.wait_for(lambda: rw._writers_waiting == 1, 60)
        answers = _post(remote, "/sessions/wait", {"owner": "o", "timeout_s": 30})["turns"]
        writer.join(60)
        assert committed.is_set() and [(a["session_id"], a["version"]) for a in answers] == [("q", 1)]

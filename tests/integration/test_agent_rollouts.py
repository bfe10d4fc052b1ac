"""Tool-calling rollouts end to end on the CPU: the turn loop over both engines, and the trainer with tools.

A random tiny model never writes a tool call, so a scripted parser stands in for the model's intent (it
"finds" a call in the first turns); everything after it is real: `ToolRunner` runs the tools (a hanging one
times out), `continuation_ids` renders the results with the `chatml_tools` template, the engine continues
the sequence, the mask marks the tool tokens, and the trainer trains on the model's tokens only.
"""

from __future__ import annotations

import json
import math

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.tools import add, hang
from tests.helpers.toy_task import tiny_model, toy_rows
from tests.integration.test_trainer_learns import toy_config

from cohort.agents.rollout_loop import TurnLoop
from cohort.agents.templates import apply_chat_template_override
from cohort.agents.tools import ToolCall
from cohort.engine import CohortEngine
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.types import SamplingParams


def scripted_parser(text, tokenizer=None):
    """Every turn 'calls' add(2, 3); the turn loop's max_iterations decides how many rounds happen."""
    return [ToolCall("add", {"a": 2, "b": 3})]


def chat_tokenizer():
    return apply_chat_template_override(make_tiny_tokenizer(), "chatml_tools")


def prompts_for(tok, n=2):
    convs = [[{"role": "user", "content": f"Say the digit {d}"}] for d in range(n)]
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for c in convs]
    return convs, ids


class ScriptedTurns:
    """One conversation's parser: turn 1 calls add and an unknown tool, turn 2 a tool that hangs."""

    def __init__(self):
        self.turn = 0

    def __call__(self, text, tokenizer=None):
        self.turn += 1
        if self.turn == 1:
            return [ToolCall("add", {"a": 2, "b": 3}), ToolCall("missing", {})]
        return [ToolCall("hang", {"seconds": 5})]


def test_turn_loop_runs_tools_masks_their_tokens_and_matches_the_hf_reference():
    tok = chat_tokenizer()
    model = tiny_model(tok, seed=2).eval()
    convs, ids = prompts_for(tok, n=1)
    # every vocabulary token but a few ends a turn, so each turn is a token or two of the random model
    params = SamplingParams(n=1, temperature=0.0, max_tokens=200, stop_token_ids=tuple(range(3, 390)))
    results = []
    for engine in (CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=8, max_model_len=512),
                   HFGenerateEngine(model, tok)):
        loop = TurnLoop(tok, [add, hang], max_iterations=2, tool_timeout_s=0.3, parser=ScriptedTurns())
        results.append(loop.generate(engine, ids, params, prompts=convs))
    ((c,),), ((r,),) = results
    assert c.token_ids == r.token_ids and c.mask == r.mask
    assert c.turns == 3 and c.tool_calls == 3 and c.tool_failures == 2  # the unknown tool; the timeout
    text = tok.decode([t for t, m in zip(c.token_ids, c.mask) if not m], skip_special_tokens=False)
    assert "5" in text and "unknown tool" in text
    assert "'hang' timed out after 0.3 s" in text  # the hanging tool (5 s) was cut at its 0.3 s timeout
    assert text.count("<|im_start|>assistant") == 2  # each tool block ends by opening the next turn
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if not m)
    # what reward functions get for a conversational prompt: TRL's messages, the final answer last
    assert [m["role"] for m in c.messages] == ["assistant", "tool", "tool", "assistant", "tool", "assistant"]
    assert [t["function"]["name"] for t in c.messages[0]["tool_calls"]] == ["add", "missing"]
    assert c.messages[1] == {"role": "tool", "name": "add", "content": "5"}
    assert "tool_calls" not in c.messages[-1]
    from cohort.rollout import decode_completions

    assert decode_completions(tok, [c], conversational=True) == [c.messages]


@pytest.mark.parametrize("placement", ["colocate", "server"])
def test_trainer_with_a_tool_runs_two_steps_with_tool_metrics_and_masks(tmp_path, monkeypatch, placement):
    """Also against `cohort serve` (generation.placement=server): the tools run in the trainer, each later
    turn is one more request to the server."""
    from tests.helpers.serving import ServerProcess
    from tests.helpers.toy_task import digit_share

    cfg = toy_config(tmp_path, steps=2)
    cfg.generation.num_generations = 4
    cfg.generation.max_completion_length = 64
    cfg.generation.max_tool_calling_iterations = 1
    cfg.generation.stop_strings = ["e", " "]  # the random model's turns end within a few tokens
    cfg.train.prompts_per_step = 2
    cfg.model.chat_template = "chatml_tools"
    cfg.agent.tools = [f"{__name__}:add"]
    cfg.agent.tool_parser = f"{__name__}:scripted_parser"
    rows = tmp_path / "rows.jsonl"  # conversational prompts, encoded by the trainer's own data setup
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "digit": r["digit"]})
                            + "\n" for r in toy_rows()))
    cfg.data.source = str(rows)
    cfg.data.max_prompt_length = 1024
    tok = make_tiny_tokenizer()
    model = tiny_model(tok)
    model.config.max_position_embeddings = 1024  # the tool schema takes ~500 tokens of the tiny tokenizer
    server = None
    if placement == "server":  # the server serves the same model; the trainer's first push sets its weights
        model.save_pretrained(tmp_path / "served")
        tok.save_pretrained(tmp_path / "served")
        server = ServerProcess(tmp_path / "served")
        cfg.generation.placement, cfg.generation.server_address = "server", server.address
    try:
        _train_with_a_tool(cfg, model, tok, monkeypatch, digit_share)
    finally:
        if server is not None:
            server.kill()


def _train_with_a_tool(cfg, model, tok, monkeypatch, digit_share):
    from cohort import trainer as trainer_module
    from cohort.rewards import RewardRunner
    from cohort.setup import build_components

    comp = build_components(cfg, policy=model, tokenizer=tok, reward_runner=RewardRunner([digit_share]))
    assert comp.turn_loop is not None and comp.turn_loop.max_iterations == 1
    assert '"name": "add"' in tok.decode(comp.train_data.prompt_ids[0])  # the prompt lists the tool
    batches = []
    original = trainer_module.collect_rollouts

    def recording(*args, **kwargs):
        batches.append(original(*args, **kwargs))
        return batches[-1]

    monkeypatch.setattr(trainer_module, "collect_rollouts", recording)
    result = trainer_module.train(cfg, comp)
    if cfg.generation.placement == "server":
        from cohort.serving import RemoteEngine

        assert isinstance(comp.engine, RemoteEngine) and comp.engine.version == 2  # served, pushed each step
    assert len(result.history) == 2
    for metrics in result.history:
        assert math.isfinite(metrics["grad_norm"]) and math.isfinite(metrics["reward"])
        assert metrics["tools/call_frequency"] > 0
        assert metrics["tools/failure_frequency"] == 0.0
        assert 1.0 < metrics["tools/turns_per_completion"] <= 2.0
    multi = 0
    for batch in batches:
        for i, ids in enumerate(batch.completion_ids):
            mask = batch.token_mask(i)
            assert len(mask) == len(ids) == len(batch.sampling_logprobs[i])
            if 0 in mask:
                multi += 1
                first = mask.index(0)
                span = ids[first : first + mask[first:].index(1)]
                assert "5" in tok.decode(span)  # add(2, 3), rendered as the tool's message
                assert mask[0] == 1 and mask[-1] == 1  # the model speaks first and last
    assert multi > 0


@pytest.mark.parametrize("iterations", [0])
def test_zero_iterations_is_single_turn(iterations):
    tok = chat_tokenizer()
    model = tiny_model(tok, seed=2).eval()
    convs, ids = prompts_for(tok)
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=8, max_model_len=512)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=40, stop_token_ids=tuple(range(3, 390)))
    loop = TurnLoop(tok, [add], max_iterations=iterations, parser=scripted_parser)
    out = loop.generate(engine, ids, params, prompts=convs)
    assert all(c.turns == 1 and c.tool_calls == 0 and set(c.mask) == {1} for g in out for c in g)


def test_turns_ended_by_stop_strings_match_the_hf_reference():
    """A turn cut by a stop string has no end-of-turn token: the continuation starts by closing the turn."""
    tok = chat_tokenizer()
    model = tiny_model(tok, seed=2).eval()
    convs, ids = prompts_for(tok, n=3)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=150, stop_strings=("a", "1", "\n"))
    results = []
    for engine in (CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=8, max_model_len=1024),
                   HFGenerateEngine(model, tok)):
        results.append(TurnLoop(tok, [add], max_iterations=3, parser=scripted_parser).generate(
            engine, ids, params, prompts=convs))
    ours, ref = results
    for group, ref_group in zip(ours, ref):
        for c, r in zip(group, ref_group):
            assert c.token_ids == r.token_ids and c.mask == r.mask
            assert c.turns == 4 and c.tool_calls == 3
            first_context = c.token_ids[c.mask.index(0)]
            assert first_context == tok.eos_token_id  # <|im_end|> closes the model's turn, as context


def test_each_completion_can_have_its_own_tool_runner():
    """What environments need: every rollout calls the tools of its own instance."""
    tok = chat_tokenizer()
    model = tiny_model(tok, seed=2).eval()
    convs, ids = prompts_for(tok, n=2)

    class Counter:
        def __init__(self, k):
            self.k, self.calls = k, 0

        def run(self, calls):
            from cohort.agents.tools import ToolResult

            self.calls += len(calls)
            return [ToolResult(c.name, f"runner {self.k}") for c in calls]

    runners = [Counter(k) for k in range(4)]
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=8, max_model_len=1024)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=150, stop_strings=("a", "1", "\n"))
    out = TurnLoop(tok, [add], max_iterations=1, parser=scripted_parser).generate(
        engine, ids, params, prompts=convs, runners=runners)
    for k, c in enumerate(c for g in out for c in g):
        assert runners[k].calls == c.tool_calls == 1
        assert c.messages[1]["content"] == f"runner {k}"


def test_inline_tools_give_the_same_rollouts_as_the_thread_pool():
    """inline_tools=True runs the tools and renders their results on the engine's thread: same tokens, masks,
    tool counts and messages as the pool, timeouts included; so does "auto" (tests/integration/
    test_turn_loop_placement.py checks a run that moves from inline to the pool midway)."""
    tok = chat_tokenizer()
    model = tiny_model(tok, seed=2).eval()
    convs, ids = prompts_for(tok, n=2)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=200, stop_token_ids=tuple(range(3, 390)))
    out = []
    for inline in (False, True, "auto"):
        engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=8, max_model_len=512)
        loop = TurnLoop(tok, [add, hang], max_iterations=2, tool_timeout_s=0.3, parser=scripted_parser,
                        inline_tools=inline)
        out.append([c for g in loop.generate(engine, ids, params, prompts=convs) for c in g])
    for a, b, c in zip(*out):
        assert a.token_ids == b.token_ids == c.token_ids and a.mask == b.mask == c.mask
        assert a.turns == b.turns == c.turns == 3
        assert (a.tool_calls, a.tool_failures, a.messages) == (b.tool_calls, b.tool_failures, b.messages)
        assert (a.tool_calls, a.tool_failures, a.messages) == (c.tool_calls, c.tool_failures, c.messages)

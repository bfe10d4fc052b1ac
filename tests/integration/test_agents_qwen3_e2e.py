"""Qwen3's tool format end to end: a tiny random-weight Qwen3 with the real Qwen3 tokenizer writes a tool call,
cohort parses it, runs the calculator, continues the sequence with the template's tool-result block, and the
model answers; then the packed loss keeps the tool result out of the gradient.

A random model never writes a tool call, so the fixture first overfits it (on the CPU, in seconds) to one
scripted conversation: the Qwen3 prompt with the calculator tool (enable_thinking=False), the completion
`<tool_call>...34 + 56...</tool_call><|im_end|>`, the tool-result continuation the template renders, and the
answer `90<|im_end|>`, with the loss on the model's own tokens only. Greedy decoding then reproduces the script.
Everything after that is cohort's real path: `TurnLoop` with the default parser (`parse_tool_calls`), the
built-in calculator under `ToolRunner`, `continuation_ids` with the real chat template, the paged engine and the
HF reference backend, and `PolicyUpdater`'s packed forward and loss.

Training cost: the model has Qwen3's real vocabulary (151669 rows), but a full-vocabulary Adam step is most of
a second on 2 busy cores, so training touches only the rows of the tokens in the conversation (a copy of those
rows is the trained parameter, written back afterwards) and scores them against an extra constant 0 logit,
which stands for every other row: those stay at their small random init, so their logits stay near 0 and the
trained token must beat them by a margin (checked on the full vocabulary before any test uses the model).
"""

from __future__ import annotations

import time

import pytest
import torch
from tests.helpers.qwen3_tokenizer import load_qwen3_tokenizer
from tests.integration.test_token_mask import _Capture, _no_timer, _PerturbMasked

from cohort.agents.builtins import calculator
from cohort.agents.messages import assistant_message, continuation_ids, tool_result_messages
from cohort.agents.parsing import parse_tool_calls
from cohort.agents.rollout_loop import TurnLoop
from cohort.agents.tools import ToolCall, ToolRunner, build_tools, tool_schemas
from cohort.algorithms import build_policy_loss
from cohort.engine import CohortEngine
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.rollout import RolloutBatch
from cohort.types import SamplingParams
from cohort.update import PolicyUpdater, UpdateSettings

TEMPLATE = {"enable_thinking": False}
CONVERSATION = [{"role": "user", "content": "What is 34 + 56?"}]
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "34 + 56"}}\n</tool_call><|im_end|>'
ANSWER = "90<|im_end|>"
# what Qwen3's template renders after the model's <|im_end|> for one tool result, then the next assistant header
# (with enable_thinking=False, the empty think block)
CONTINUATION = ("\n<|im_start|>user\n<tool_response>\n90\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                "<think>\n\n</think>\n\n")
MAX_STEPS, MIN_MARGIN = 400, 2.0


class Script:
    """The scripted conversation's token ids, built with the same helpers the turn loop uses."""

    def __init__(self, tok):
        self.tools = build_tools([calculator])
        text = tok.apply_chat_template(CONVERSATION, tools=tool_schemas(self.tools), tokenize=False,
                                       add_generation_prompt=True, **TEMPLATE)
        self.prompt = tok(text, add_special_tokens=False)["input_ids"]
        self.call = tok(TOOL_CALL, add_special_tokens=False)["input_ids"]
        calls = parse_tool_calls(TOOL_CALL, tok)
        results = ToolRunner(self.tools).run(calls)
        said = tok.decode(self.call, skip_special_tokens=True)  # what the loop records as the assistant's text
        self.continuation = continuation_ids(tok, [*CONVERSATION, assistant_message(said, calls)],
                                             tool_result_messages(results), self.tools, **TEMPLATE)
        self.answer = tok(ANSWER, add_special_tokens=False)["input_ids"]
        self.completion = self.call + self.continuation + self.answer
        self.mask = [1] * len(self.call) + [0] * len(self.continuation) + [1] * len(self.answer)
        self.sequence = self.prompt + self.completion
        # positions whose next token the model writes (the logits at p predict token p + 1)
        start = len(self.prompt)
        self.trained = [start - 1 + k for k, m in enumerate(self.mask) if m]


def overfit_tiny_qwen3(tok, script: Script, seed: int = 0) -> torch.nn.Module:
    """A 1-layer Qwen3 (hidden 32, tied embeddings, the real vocabulary) trained until greedy decoding of the
    script's model tokens is right with a margin, on the full vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
                         max_position_embeddings=1024, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config)
    embedding = model.get_input_embeddings().weight
    used = sorted(set(script.sequence))
    local = {t: i for i, t in enumerate(used)}
    rows = torch.nn.Parameter(embedding.detach()[used].clone())  # the only rows the script touches
    inputs = torch.tensor([[local[t] for t in script.sequence]])
    positions = torch.tensor(script.trained)
    targets = torch.tensor([local[script.sequence[p + 1]] for p in script.trained])
    zero = torch.zeros(len(positions), 1)  # stands for the untrained rows' logits (near 0)
    params = [rows, *(p for p in model.parameters() if p is not embedding)]
    opt = torch.optim.Adam(params, lr=1e-2)
    model.train()
    for _ in range(MAX_STEPS):
        hidden = model.model(inputs_embeds=rows[inputs]).last_hidden_state[0, positions]
        logits = torch.cat([hidden @ rows.T, zero], dim=1)
        loss = torch.nn.functional.cross_entropy(logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 2e-3:
            break
    model.eval()
    with torch.no_grad():
        embedding[used] = rows
        logits = model(input_ids=torch.tensor([script.sequence]), logits_to_keep=positions).logits[0]
    want = torch.tensor([script.sequence[p + 1] for p in script.trained])
    top = logits.topk(2, dim=-1)
    assert torch.equal(top.indices[:, 0], want), "the tiny Qwen3 did not learn the script"
    margin = (top.values[:, 0] - top.values[:, 1]).min().item()
    assert margin > MIN_MARGIN, f"greedy margin {margin:.2f} is too thin for engine-vs-HF float differences"
    return model


@pytest.fixture(scope="module")
def setup():
    tok = load_qwen3_tokenizer()
    script = Script(tok)
    start = time.monotonic()
    model = overfit_tiny_qwen3(tok, script)
    print(f"overfit the tiny Qwen3 in {time.monotonic() - start:.1f} s")
    return tok, script, model


def test_the_script_is_qwen3s_format(setup):
    tok, script, _ = setup
    assert tok.decode(script.continuation) == CONTINUATION
    assert tok.convert_tokens_to_ids("<tool_call>") == script.call[0]  # one special-vocabulary token
    assert script.call[-1] == script.answer[-1] == tok.eos_token_id  # <|im_end|> ends each model turn
    assert tok.decode(script.prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_turn_loop_on_both_engines_parses_runs_continues_and_masks(setup):
    tok, script, model = setup
    params = SamplingParams(n=1, temperature=0.0, max_tokens=96)
    engine = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], block_size=8, max_model_len=512)
    results = []
    for backend in (engine, HFGenerateEngine(model, tok)):
        loop = TurnLoop(tok, [calculator], max_iterations=2, template_kwargs=TEMPLATE)  # the real parser
        ((c,),) = loop.generate(backend, [script.prompt], params, prompts=[CONVERSATION])
        results.append(c)
    ours, ref = results
    assert ours.token_ids == ref.token_ids and ours.mask == ref.mask
    assert ours.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    for c in results:
        assert c.token_ids == script.completion  # the model wrote the call, then, after the result, the answer
        text = tok.decode(c.token_ids)
        assert text.startswith(TOOL_CALL) and text == TOOL_CALL + CONTINUATION + ANSWER
        assert c.turns == 2 and c.tool_calls == 1 and c.tool_failures == 0
        assert c.finish_reason == "stop"
        assert c.mask == script.mask  # 0 exactly on the template's tool-result block
        assert tok.decode([t for t, m in zip(c.token_ids, c.mask) if not m]) == CONTINUATION
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if not m)
        assert [m["role"] for m in c.messages] == ["assistant", "tool", "assistant"]
        assert c.messages[0]["tool_calls"][0]["function"]["name"] == "calculator"
        assert c.messages[1] == {"role": "tool", "name": "calculator", "content": "90"}
        assert c.messages[2]["content"] == "90"
    assert parse_tool_calls(tok.decode(script.call)) == [ToolCall("calculator", {"expression": "34 + 56"})]
    # no re-prefill: the prompt once, then the continuation plus the first turn's last sampled token
    assert engine.stats.prefill_tokens == len(script.prompt) + len(script.continuation) + 1


def _update(model, script: Script, loss, advantages):
    """One PolicyUpdater step on `len(advantages)` copies of the scripted completion; the would-be gradients."""
    settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=100_000, temperature=1.0,
                              max_grad_norm=1e9, max_completion_length=96)
    capture = _Capture(list(model.parameters()))
    n = len(advantages)
    batch = RolloutBatch(
        prompt_ids=[script.prompt] * n, completion_ids=[script.completion] * n,
        sampling_logprobs=[[-0.5 if m else 0.0 for m in script.mask]] * n, finish_reasons=["stop"] * n,
        completions_text=[""] * n, prompts=[""] * n, rewards_per_func=torch.zeros(n, 1), rewards=torch.zeros(n),
        advantages=torch.tensor(advantages), loss_mask_keep=[True] * n, group_size=2, completion_masks=[list(script.mask)] * n)
    PolicyUpdater(model, capture, capture, loss, settings).update(batch, _no_timer)
    return capture.grads


def test_packed_loss_gives_the_tool_result_no_gradient(setup):
    _, script, trained = setup
    model = type(trained)(trained.config)
    model.load_state_dict(trained.state_dict())  # a copy: the update must not disturb the shared model
    model.train()
    advantages = [1.0, -0.5]
    clean = _PerturbMasked(build_policy_loss("grpo", {}), 0.0)
    grads = _update(model, script, clean, advantages)
    inputs = clean.seen[0]
    rows = inputs.mask[:, : len(script.mask)]
    assert rows.tolist() == [script.mask] * 2 and int(inputs.mask.sum()) == 2 * sum(script.mask)
    grad = inputs.logprobs.grad
    assert torch.all(grad[inputs.mask == 0] == 0)  # tool-result positions (and padding): exactly zero
    assert torch.count_nonzero(grad[inputs.mask == 1]) > 0
    # the parameters' gradient cannot see the tool-result positions at all: noise there changes nothing
    noisy = _update(model, script, _PerturbMasked(build_policy_loss("grpo", {}), 3.0), advantages)
    assert any(g.abs().sum() > 0 for g in grads)
    for a, b in zip(grads, noisy):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)

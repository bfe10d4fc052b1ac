"""environment_factory in training and evaluation (issue 12): per-rollout instances reset with their row, reset's
text in the prompt (one encoding per group when the G resets agree, one per rollout when they differ), the
instance's methods as the rollout's tools, get_reward as one more reward column that reaches the advantages,
routing by the `environment` column; GRPOTrainer(tools=...) on the facade; the calculator recipe."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model, toy_rows
from tests.integration.test_trainer_learns import toy_config

from cohort.agents.tools import ToolCall
from cohort.algorithms import compute_advantages
from cohort.errors import ConfigError

G = 4


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def call_press(text, tokenizer=None):
    """Every turn calls the environment's `press` (the random tiny model writes no tool calls itself)."""
    return [ToolCall("press", {})]


class Button:
    """Reward 1 for the first rollout of each group only: rollouts are numbered by their resets."""

    resets = 0

    def reset(self, digit: str = "", **row) -> str:
        Button.resets += 1
        self.k, self.pressed = Button.resets, 0
        return f" Target {digit}."

    def press(self) -> str:
        """Press the button."""
        self.pressed += 1
        return f"pressed {self.pressed}"

    def get_reward(self) -> float:
        return 1.0 if self.k % G == 1 else 0.0


class Varied:
    """reset returns a different text for every rollout: each is encoded on its own."""

    resets = 0

    def reset(self, **row) -> str:
        Varied.resets += 1
        return f" Rollout {Varied.resets}."

    def press(self) -> str:
        """Press the button."""
        return "ok"


class Alpha:
    def reset(self, **row) -> str:
        assert "environment" not in row  # the routing column is not forwarded
        return " Alpha."

    def press(self) -> str:
        """Press the alpha button."""
        return "alpha"

    def get_reward(self) -> float:
        return 1.0


class Beta:
    def reset(self, **row) -> None:
        return None

    def turn(self, times: int) -> str:
        """Turn the beta knob.

        Args:
            times: How many times.
        """
        return "beta"


class NoReset:
    def press(self) -> str:
        """Press."""
        return "x"


def _setup(tmp_path, factory, rows=None, reward_runner="zero", parser="call_press", **agent):
    from cohort.rewards import RewardRunner
    from cohort.setup import build_components

    cfg = toy_config(tmp_path, steps=1)
    cfg.generation.num_generations = G
    cfg.generation.max_completion_length = 96
    cfg.generation.max_tool_calling_iterations = 1
    cfg.generation.stop_strings = ["e", " "]  # the random model's turns end within a few tokens
    cfg.train.prompts_per_step = 2
    cfg.model.chat_template = "chatml_tools"
    cfg.agent.environment_factory = factory
    cfg.agent.tool_parser = f"{__name__}:{parser}"
    for key, value in agent.items():
        setattr(cfg.agent, key, value)
    path = tmp_path / "rows.jsonl"
    rows = rows or [{"prompt": [{"role": "user", "content": r["prompt"]}], "digit": r["digit"]} for r in toy_rows(1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.data.source = str(path)
    cfg.data.max_prompt_length = 1024
    tok = make_tiny_tokenizer()
    model = tiny_model(tok)
    model.config.max_position_embeddings = 1400
    if reward_runner == "zero":
        reward_runner = RewardRunner([zero_reward])
    else:  # the run's own: reward.funcs
        cfg.reward.funcs = []
    comp = build_components(cfg, policy=model, tokenizer=tok, reward_runner=reward_runner)
    return cfg, comp, tok


def _rollouts(cfg, comp, prompts=2):
    from cohort.rollout import collect_rollouts
    from cohort.types import TrainerState

    def next_prompts(n):
        return comp.train_data.batch(list(range(n)))

    return collect_rollouts(comp.engine, comp.tokenizer, next_prompts, prompts, comp.sampling_params,
                            comp.reward_runner, advantage_kwargs=comp.advantage_kwargs,
                            trainer_state=TrainerState(global_step=0, max_steps=1), turn_loop=comp.turn_loop)


def test_get_reward_reaches_the_advantages_and_reset_text_the_prompt(tmp_path):
    Button.resets = 0
    cfg, comp, tok = _setup(tmp_path, f"{__name__}:Button")
    assert comp.reward_runner.names == ["zero_reward", "Button"]
    assert comp.advantage_kwargs["reward_weights"] == [1.0, 1.0]
    Button.resets = 0
    batch = _rollouts(cfg, comp)
    env_column = batch.rewards_per_func[:, 1]
    assert env_column.tolist() == [1.0, 0.0, 0.0, 0.0] * 2  # one rewarded rollout per group
    expected = compute_advantages(batch.rewards_per_func, G, **comp.advantage_kwargs).advantages
    assert torch.allclose(batch.advantages, expected)
    adv = batch.advantages.view(2, G)
    assert (adv[:, 0] > 0).all() and (adv[:, 1:] < 0).all()  # without the environment's column: all 0
    assert batch.metrics["rewards/Button/mean"] == pytest.approx(0.25)
    for i in range(len(batch)):  # the group kept one encoding, with reset's text in the last user message
        assert batch.prompt_ids[i] is batch.prompt_ids[i // G * G]
        assert f"Target {i // G}." in tok.decode(batch.prompt_ids[i])
        assert batch.prompts[i][-1]["content"].endswith(f" Target {i // G}.")
    assert any(0 in batch.token_mask(i) for i in range(len(batch)))  # press() results came back as context
    assert any("pressed 1" in tok.decode(ids) for ids in batch.completion_ids)


def test_different_reset_texts_are_encoded_per_rollout(tmp_path):
    cfg, comp, tok = _setup(tmp_path, f"{__name__}:Varied")
    Varied.resets = 0
    batch = _rollouts(cfg, comp)
    assert len(batch) == 2 * G and batch.advantages.shape == (2 * G,)
    for i in range(len(batch)):
        assert f"Rollout {i + 1}." in tok.decode(batch.prompt_ids[i])
    assert len({tuple(ids) for ids in batch.prompt_ids}) == 2 * G


def test_routing_by_the_environment_column(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"Task {k}"}], "environment": name}
            for k, name in enumerate(["a", "b"] * 3)]
    cfg, comp, tok = _setup(tmp_path, {"a": f"{__name__}:Alpha", "b": f"{__name__}:Beta"}, rows)
    assert comp.reward_runner.names == ["zero_reward", "Alpha"]
    batch = _rollouts(cfg, comp)
    for i in range(len(batch)):
        text = tok.decode(batch.prompt_ids[i])
        if i < G:  # row 0 routes to Alpha: its text, its tool only
            assert "Alpha." in text and '"press"' in text and '"turn"' not in text
            assert batch.rewards_per_func[i, 1] == 1.0
        else:
            assert "Alpha." not in text and '"turn"' in text and '"press"' not in text
            assert math.isnan(batch.rewards_per_func[i, 1])  # not applicable: Beta has no get_reward


def test_environment_without_reset_fails_before_the_model_loads(tmp_path):
    from cohort.config import CohortConfig
    from cohort.setup import build_components

    cfg = CohortConfig()
    cfg.model.name_or_path = str(tmp_path / "no-such-model")  # loading it would fail with another message
    cfg.agent.environment_factory = f"{__name__}:NoReset"
    with pytest.raises(ConfigError, match=r"NoReset .*has no reset method"):
        build_components(cfg)


def test_training_and_evaluation_run_with_an_environment(tmp_path):
    from cohort import trainer as trainer_module
    from cohort.evaluation import evaluate

    cfg, comp, _ = _setup(tmp_path, f"{__name__}:Button")
    cfg.train.max_steps = 2
    result = trainer_module.train(cfg, comp)
    assert len(result.history) == 2
    for metrics in result.history:
        assert math.isfinite(metrics["grad_norm"]) and "rewards/Button/mean" in metrics
        assert metrics["tools/call_frequency"] > 0
    comp = dataclasses.replace(comp, eval_data=comp.train_data.head(2))
    samples = []
    out = evaluate(comp, cfg, samples=samples)
    assert math.isfinite(out["reward"]) and len(samples) == 2
    assert samples[0]["prompt"][-1]["content"].endswith(" Target 0.")


def test_facade_tools_run_two_steps(tmp_path):
    from tests.integration.test_agent_rollouts import add

    from cohort.trl_compat import GRPOConfig, GRPOTrainer

    tok = make_tiny_tokenizer()
    model = tiny_model(tok)
    model.config.max_position_embeddings = 1400
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "digit": r["digit"]} for r in toy_rows(1)]
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=96, max_tool_calling_iterations=1,
                      report_to="none", use_cpu=True, logging_steps=1,
                      extra={"generation.stop_strings": ["e", " "], "agent.tool_parser": f"{__name__}:call_add"})
    with pytest.raises(ConfigError, match="chatml_tools"):  # the tiny tokenizer's template cannot render tools
        GRPOTrainer(model=model, reward_funcs=zero_reward, args=args, train_dataset=rows, processing_class=tok,
                    tools=[add]).train()
    args.extra["model.chat_template"] = "chatml_tools"
    trainer = GRPOTrainer(model=model, reward_funcs=zero_reward, args=args, train_dataset=rows,
                          processing_class=tok, tools=[add])
    assert trainer.config.agent.tools == [add]
    trainer.train()
    history = trainer.result.history
    assert len(history) == 2 and all(m["tools/call_frequency"] > 0 for m in history)
    assert '"name": "add"' in tok.decode(trainer._comp.train_data.prompt_ids[0])


def call_add(text, tokenizer=None):
    return [ToolCall("add", {"a": 2, "b": 3})]


def test_calculator_recipe_parses_and_validates():
    from cohort.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes" / "calculator_agent.yaml")
    cfg.validate()
    assert cfg.model.chat_template == "chatml_tools"
    assert cfg.agent.tools == ["cohort.agents.builtins:calculator"]
    assert cfg.generation.max_tool_calling_iterations == 3
    assert cfg.data.options["min_terms"] == cfg.data.options["max_terms"] == 4
    # the worked examples are real chat turns: an assistant tool call, the tool's answer, the final number
    roles = [m["role"] for m in cfg.data.few_shot]
    assert roles == ["user", "assistant", "tool", "assistant"] * 2
    assert cfg.data.few_shot[1]["tool_calls"][0]["name"] == "calculator"


def test_environments_may_bring_every_reward(tmp_path):
    """reward.funcs may be empty when the environments score the rollouts (TRL's environment-owned reward); a run
    left with no reward function at all fails before it samples, naming both ways out."""
    Button.resets = 0
    cfg, comp, _ = _setup(tmp_path, f"{__name__}:Button", reward_runner=None)
    assert comp.reward_runner.names == ["Button"] and comp.reward_runner.weights.tolist() == [1.0]
    Button.resets = 0
    batch = _rollouts(cfg, comp)
    assert batch.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 0.0, 0.0] * 2
    with pytest.raises(ConfigError, match="no reward function: reward_funcs is empty and no environment"):
        _setup(tmp_path, f"{__name__}:Varied", reward_runner=None)


class Pressless:
    """An environment whose rollouts only ever write malformed calls."""

    def reset(self, **row) -> None:
        return None

    def press(self) -> str:
        """Press the button."""
        return "pressed"


def malformed(text, tokenizer=None):
    from cohort.agents.tools import INVALID_TOOL_NAME

    return [ToolCall(INVALID_TOOL_NAME, {"raw": "{a: 3}", "error": "not valid JSON"})]


@pytest.mark.parametrize("mode", ["feedback", "end"])
def test_malformed_tool_calls_get_feedback_or_end_the_completion(tmp_path, mode):
    """agent.malformed_tool_calls: "feedback" answers a call the parser could not read with an error (a failed
    call, the completion goes on); "end" (TRL's way, the facade's default) makes it no call at all."""
    cfg, comp, _ = _setup(tmp_path, f"{__name__}:Pressless", parser="malformed", malformed_tool_calls=mode)
    assert comp.turn_loop.malformed_tool_calls == mode
    batch = _rollouts(cfg, comp)
    if mode == "feedback":
        assert batch.metrics["tools/call_frequency"] > 0 and batch.metrics["tools/failure_frequency"] == 1.0
    else:
        assert batch.metrics.get("tools/call_frequency", 0.0) == 0.0
        assert all(0 not in batch.token_mask(i) for i in range(len(batch)))

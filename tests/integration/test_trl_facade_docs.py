"""TRL 1.16's GRPO documentation examples (docs/source/grpo_trainer.md: quick start, the reward-function examples,
multi-task rewards, async rewards, PEFT) run with only the import changed, on a tiny local model and a tiny local
dataset in place of the hub ones. Where a documented argument would make a CPU test slow, the line says so."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from cohort import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer

datasets = pytest.importorskip("datasets", reason="the examples use datasets.Dataset: pip install datasets")
Dataset = datasets.Dataset
TRL_MISSING = "runs TRL's own code: pip install trl==1.16.0"

MATH = [{"prompt": [{"role": "user", "content": "What is 2+2? Put the answer in \\boxed{}."}], "solution": "4"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama that ends its completions after a few tokens (a bias towards EOS in the last layer), with room
    for TRL's default max_completion_length=512, saved with its tokenizer as a local "hub" folder."""
    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                      tie_word_embeddings=True, attention_bias=True)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.zero_()
        eos = model.model.embed_tokens.weight[tok.eos_token_id]
        eos *= 0.25 / eos.norm()  # with the bias below: EOS after 1-9 tokens, whatever the prompt
        model.model.layers[-1].self_attn.o_proj.bias.copy_(50.0 * eos / eos.norm())
    path = tmp_path_factory.mktemp("hub") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _small(tmp_path, **kw):  # the documented defaults, with short completions so a CPU test is quick
    base = dict(output_dir=str(tmp_path / "out"), max_completion_length=8, per_device_train_batch_size=4,
                num_generations=4, max_steps=2)
    return GRPOConfig(**{**base, **kw})


def _trls_accuracy_reward():
    """TRL's own reward function (it calls log_extra); it needs trl and math-verify, else the test skips."""
    pytest.importorskip("math_verify", reason="TRL's accuracy_reward needs math-verify: pip install math-verify")
    return pytest.importorskip("trl.rewards", reason=TRL_MISSING).accuracy_reward


def test_quick_start(model_dir, tmp_path, monkeypatch):
    accuracy_reward = _trls_accuracy_reward()

    monkeypatch.chdir(tmp_path)
    dataset = Dataset.from_list(MATH)  # was: load_dataset("trl-lib/DeepMath-103K", split="train")

    trainer = GRPOTrainer(
        model=model_dir,  # was: "Qwen/Qwen2-0.5B-Instruct"
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    trainer.train()
    # TRL's defaults: output_dir "<model>-GRPO", 3 epochs of 1 generation batch (1 prompt x 8 completions)
    assert trainer.args.output_dir == "model-GRPO" and (tmp_path / "model-GRPO").is_dir()
    assert trainer.state.global_step == 3
    assert "rewards/accuracy_reward/mean" in trainer.state.log_history[0]


def test_reward_longer_completions_in_tokens_and_characters(model_dir, tmp_path):
    def reward_func(completion_ids, **kwargs):  # the docs spell it completions_ids; TRL passes completion_ids
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    def reward_chars(completions, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of character count)."""
        return [float(len(completion)) for completion in completions]

    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward_func, reward_chars], args=_small(tmp_path),
                          train_dataset=Dataset.from_list([{"prompt": "The sky is"}, {"prompt": "The sun is"}]))
    history = trainer.train().history
    assert history[0]["rewards/reward_func/mean"] == history[0]["completions/mean_length"]


def test_format_reward_on_a_conversational_dataset(model_dir, tmp_path):
    import re

    def format_reward_func(completions, **kwargs):
        """Reward function that checks if the completion has a specific format."""
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        completion_contents = [completion[0]["content"] for completion in completions]
        matches = [re.match(pattern, content) for content in completion_contents]
        return [1.0 if match else 0.0 for match in matches]

    trainer = GRPOTrainer(model=model_dir, reward_funcs=format_reward_func, args=_small(tmp_path),
                          train_dataset=Dataset.from_list(MATH * 4))
    assert trainer.train().history[0]["rewards/format_reward_func/mean"] == 0.0


def test_reward_from_a_reference_column(model_dir, tmp_path):
    import re

    def reward_func(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    rows = [{"prompt": "Problem: Solve the equation $2x + 3 = 7$. Solution:", "ground_truth": "2"},
            {"prompt": "Problem: Solve the equation $3x - 5 = 10$.", "ground_truth": "5"}]
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_func, args=_small(tmp_path),
                          train_dataset=Dataset.from_list(rows))
    assert len(trainer.train().history) == 2


def test_multi_task_rewards_with_none(model_dir, tmp_path):
    def check_math_solution(prompt, completion):
        return "4" in completion

    def test_code_solution(prompt, completion):
        return "def" in completion

    # Define a dataset that contains both math and coding problems
    dataset = Dataset.from_list(
        [
            {"prompt": "What is 2+2?", "task": "math"},
            {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
            {"prompt": "What is 3*4?", "task": "math"},
            {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
        ]
    )

    # Math-specific reward function
    def math_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "math":
                correct = check_math_solution(prompt, completion)
                rewards.append(1.0 if correct else -1.0)
            else:
                rewards.append(None)  # Return None for non-math tasks
        return rewards

    # Coding-specific reward function
    def coding_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "code":
                works = test_code_solution(prompt, completion)
                rewards.append(1.0 if works else -1.0)
            else:
                rewards.append(None)  # Return None for non-coding tasks
        return rewards

    trainer = GRPOTrainer(model=model_dir, reward_funcs=[math_reward_func, coding_reward_func],
                          args=_small(tmp_path, per_device_train_batch_size=16, max_steps=1), train_dataset=dataset)
    row = trainer.train().history[0]
    # each function scored only its own task's half (None elsewhere), and a None adds nothing (TRL's nansum)
    math, code = row["rewards/math_reward_func/mean"], row["rewards/coding_reward_func/mean"]
    assert -1.0 <= math <= 1.0 and -1.0 <= code <= 1.0
    assert row["reward"] == pytest.approx((math + code) / 2)


def test_async_reward_functions_with_a_sync_one(model_dir, tmp_path):
    import asyncio

    async def async_reward_func(prompts, completions, **kwargs):
        # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
        await asyncio.sleep(0.01)
        # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
        return [1.0 if completion else 0.0 for completion in completions]

    def reward_func(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    trainer = GRPOTrainer(model=model_dir, reward_funcs=[reward_func, async_reward_func],
                          args=_small(tmp_path, reward_weights=[0.0, 1.0]),
                          train_dataset=Dataset.from_list([{"prompt": "The sky is"}] * 4))
    assert trainer.train().history[0]["rewards/async_reward_func/mean"] == 1.0


def test_peft_lora(model_dir, tmp_path):
    peft = pytest.importorskip("peft", reason="needs peft (LoRA): pip install peft")

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward_len,
        args=_small(tmp_path, learning_rate=1e-5, logging_steps=10, gradient_accumulation_steps=1),
        train_dataset=Dataset.from_list([{"prompt": "Write a haiku about the sea."}] * 4),
        peft_config=peft.LoraConfig(task_type="CAUSAL_LM"),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_config.json").is_file()


def test_log_extra_columns_of_trls_accuracy_reward_reach_the_samples(model_dir, tmp_path):
    import json

    accuracy_reward = _trls_accuracy_reward()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=accuracy_reward, train_dataset=Dataset.from_list(MATH * 2),
                          args=_small(tmp_path, log_completions=True, max_steps=1))
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["solution"] == "4" and "answer_parsed" in r for r in rows)


def test_trls_own_grpo_script_with_cohorts_classes(model_dir, tmp_path, monkeypatch):
    """trl/scripts/grpo.py (`trl grpo ...`), its command line parsed by TrlParser into cohort's GRPOConfig and
    run by cohort's GRPOTrainer: the script's `from trl import GRPOConfig, GRPOTrainer` is the only change."""
    import json

    trl = pytest.importorskip("trl", reason=TRL_MISSING)
    from trl.scripts import grpo

    import cohort

    monkeypatch.setattr(trl, "GRPOConfig", cohort.GRPOConfig)
    monkeypatch.setattr(trl, "GRPOTrainer", cohort.GRPOTrainer)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MATH * 4))
    argv = ["--model_name_or_path", model_dir, "--dataset_name", str(data), "--reward_funcs", "accuracy_reward",
            "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--per_device_train_batch_size", "4",
            "--num_generations", "4", "--max_completion_length", "16", "--use_cpu", "--report_to", "none",
            "--logging_steps", "1"]
    script_args, training_args, model_args, dataset_args = grpo.make_parser().parse_args_and_config(args=argv)
    assert isinstance(training_args, cohort.GRPOConfig)
    grpo.main(script_args, training_args, model_args, dataset_args)
    assert (tmp_path / "out" / "config.json").is_file()  # trainer.save_model(training_args.output_dir)

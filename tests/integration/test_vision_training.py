"""GRPO on prompts with images through the whole trainer (issue 17), on tiny random VLMs on the CPU.

The learning test can only be passed by a policy that reads the image: every prompt is the same text
("what colour is this ?") over a solid red, green or blue image, and the reward is 1 when the answer is the
image's colour. A policy blind to the image can reach at most 1/3 (always the same colour, or any mix).
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_vlms import build

from cohort.config import CohortConfig
from cohort.engine import CohortEngine
from cohort.rewards import RewardRunner
from cohort.setup import build_components
from cohort.trainer import train
from cohort.types import SamplingParams
from cohort.vision.engine import VisionGroupEngine
from cohort.vision.inputs import VisionPrompt

SEEN: dict[str, list] = {}


def right_colour(completions, colour, image, **kwargs):
    """1 when the answer's first word is the image's colour (TRL signature: columns by name)."""
    SEEN.setdefault("image", []).extend(image)
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(bool(t.split()) and t.split()[0] == gold) for t, gold in zip(texts, colour)]


def vlm_config(tmp_path, steps: int, **extra) -> CohortConfig:
    cfg = CohortConfig()
    cfg.data.source = "tests.helpers.tiny_vlms:colour_rows"
    cfg.data.options = {"copies": 4}
    cfg.data.shuffle = False  # rows cycle red, green, blue: every step holds one prompt of each colour
    cfg.generation.num_generations = 12
    cfg.generation.max_completion_length = 1
    cfg.train.prompts_per_step = 3
    cfg.train.max_steps = steps
    cfg.train.learning_rate = 1e-2
    cfg.train.seed = 0
    cfg.run.output_dir = str(tmp_path / "run")
    cfg.run.report_to = ["jsonl"]
    for key, value in extra.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def odd_length(completions, **kwargs):
    """A reward that varies within every group from the first step (so one step changes the weights)."""
    return [float(len(c[-1]["content"]) % 2) for c in completions]


def components(cfg, family="qwen2_vl", seed=0, reward=right_colour):
    model, processor = build(family, seed=seed)
    return build_components(cfg, policy=model.train(), tokenizer=processor, reward_runner=RewardRunner([reward]),
                            echo=lambda *a: None)


def test_grpo_learns_to_name_the_colour_of_the_image(tmp_path):
    cfg = vlm_config(tmp_path, steps=40)
    comp = components(cfg)
    assert isinstance(comp.engine, CohortEngine)  # the paged engine runs Qwen2-VL (engine/models/vision_decoder.py)
    assert all(isinstance(ids, VisionPrompt) for ids in comp.train_data.prompt_ids)
    result = train(cfg, comp, echo=lambda *a: None)
    rewards = [m["reward"] for m in result.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > 0.7, rewards  # well above the 1/3 a policy blind to the image can reach
    assert last > first + 0.4, rewards
    # one prefill per group: each step prefills its 3 prompts once (the 12 completions share their KV blocks)
    assert comp.engine.stats.prefill_tokens == cfg.train.max_steps * sum(map(len, comp.train_data.prompt_ids[:3]))
    # greedy answers over the three images (the same text): a blind policy gets at most one right
    prompts = comp.train_data.prompt_ids[:3]
    answers = comp.engine.generate(prompts, SamplingParams(n=1, max_tokens=1, temperature=0.0))
    words = [comp.tokenizer.decode(g[0].token_ids).strip() for g in answers]
    gold = [row["colour"] for row in comp.train_data.rows[:3]]
    assert sum(w == c for w, c in zip(words, gold)) >= 2, (words, gold)
    # reward functions got the image column (PIL images, one per completion)
    assert len(SEEN["image"]) >= 3 * 16 and all(hasattr(im, "getpixel") for im in SEEN["image"][:48])


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_lora_trains_the_language_model_only(tmp_path, family):
    cfg = vlm_config(tmp_path, steps=1, model__lora_r=4)
    comp = components(cfg, family, reward=odd_length)
    trainable = [n for n, p in comp.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all("language_model" in n or "text_model" in n for n in trainable), trainable
    before = {n: p.detach().clone() for n, p in comp.policy.named_parameters() if "lora_B" in n}
    train(cfg, comp, echo=lambda *a: None)
    after = dict(comp.policy.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_freeze_vision_trains_the_language_side_only(tmp_path):
    cfg = vlm_config(tmp_path, steps=1, model__freeze_vision=True)
    comp = components(cfg, "idefics3", reward=odd_length)
    inner = comp.policy.model
    assert not any(p.requires_grad for p in inner.vision_model.parameters())
    assert not any(p.requires_grad for p in inner.connector.parameters())
    assert all(p.requires_grad for p in inner.text_model.parameters())
    vision_before = [p.detach().clone() for p in inner.vision_model.parameters()]
    text_before = [p.detach().clone() for p in inner.text_model.parameters()]
    train(cfg, comp, echo=lambda *a: None)
    assert all(torch.equal(a, b) for a, b in zip(vision_before, inner.vision_model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(text_before, inner.text_model.parameters()))


def test_generation_engine_hf_gives_the_vision_group_engine(tmp_path):
    cfg = vlm_config(tmp_path, steps=1, generation__engine="hf")
    comp = components(cfg, "idefics3", reward=odd_length)
    assert isinstance(comp.engine, VisionGroupEngine)  # never generate() on token ids alone: it would miss the images
    train(cfg, comp, echo=lambda *a: None)
    assert comp.engine.stats.prefills == 3 and comp.engine.stats.vision_passes == 3


def test_trl_facade_trains_a_vlm_with_its_processor_and_saves_it(tmp_path):
    from tests.helpers.tiny_vlms import colour_rows

    from cohort import GRPOConfig, GRPOTrainer

    model, processor = build("idefics3")
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=6, num_generations=2,
                      max_completion_length=2, max_steps=1, learning_rate=1e-3, use_cpu=True, report_to="none")
    trainer = GRPOTrainer(model=model, reward_funcs=right_colour, args=args, train_dataset=colour_rows(2),
                          processing_class=processor)
    trainer.train()
    assert isinstance(trainer._comp.train_data.prompt_ids[0], VisionPrompt)
    trainer.save_model(str(tmp_path / "out"))
    assert (tmp_path / "out" / "processor_config.json").is_file()


def test_a_vlm_folder_loads_with_its_processor_from_model_name_or_path(tmp_path):
    model, processor = build("idefics3")
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    cfg = vlm_config(tmp_path, steps=1, model__name_or_path=str(tmp_path / "vlm"), model__lora_r=2)
    comp = build_components(cfg, reward_runner=RewardRunner([odd_length]), echo=lambda *a: None)
    assert comp.processor is not None and isinstance(comp.engine, CohortEngine)
    result = train(cfg, comp, echo=lambda *a: None)
    saved = result.run_dir / "checkpoints"
    assert any(saved.rglob("preprocessor_config.json")) or any(saved.rglob("processor_config.json"))

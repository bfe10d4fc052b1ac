"""A tool that returns an image to a vision-language model (TRL's multimodal tool responses), on tiny random VLMs on
the CPU: the processor expands the image in the tool result, transformers' generate continues with it, and the
update's forward embeds it at the tool span's image tokens (the logprobs after it depend on the image, and the
vision tower gets a gradient through it)."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_vlms import build, solid

from cohort.agents.messages import tool_result_messages
from cohort.agents.rollout_loop import TurnLoop
from cohort.agents.tools import ToolCall, ToolResult
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.types import SamplingParams
from cohort.vision.conversation import VisionSequence, VisionTurns
from cohort.vision.forward import vision_packed_logprobs
from cohort.vision.model import inner_model

PROMPT = [{"role": "user", "content": "what colour is this ?"}]


def _conversation(family: str, colour: str):
    """One scripted rollout: the model says "red" (read as a call of `screenshot`), the tool returns an image of
    `colour` and a text, the model says "blue". Returns (model, processor, generate's kwargs per call, prompt ids,
    the completion)."""
    model, processor = build(family, seed=0)
    tok = processor.tokenizer
    calls: list[dict] = []
    turns = [["red", "<|im_end|>"], ["blue", "<|im_end|>"]]

    def scripted(input_ids, **kwargs):  # a replaced generate: the model's turns are fixed, the context is not
        calls.append(kwargs)
        words = turns[min(len(calls) - 1, len(turns) - 1)]
        out = torch.tensor([tok.convert_tokens_to_ids(w) for w in words]).repeat(input_ids.shape[0], 1)
        return torch.cat([input_ids, out], dim=-1)

    model.generate = scripted

    def screenshot() -> list:
        """Takes a screenshot.

        Returns:
            The screenshot and a caption.
        """
        return [{"type": "image", "image": solid(colour)}, {"type": "text", "text": "the image"}]

    loop = TurnLoop(tok, [screenshot], parser=lambda text, _tok: [ToolCall("screenshot", {})] if "red" in text else [],
                    vision=VisionTurns(processor), inline_tools=True)
    prompt_ids = processor.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if isinstance(prompt_ids, dict) else prompt_ids)
    if prompt_ids and isinstance(prompt_ids[0], list):
        prompt_ids = prompt_ids[0]
    engine = HFGenerateEngine(model, tok, eos_token_ids=[tok.eos_token_id])
    groups = loop.generate(engine, [prompt_ids], SamplingParams(n=1, max_tokens=200, seed=0), prompts=[PROMPT])
    return model, processor, calls, prompt_ids, groups[0][0]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])
def test_a_tools_image_reaches_generate_and_the_update(family):
    model, processor, calls, prompt_ids, c = _conversation(family, "red")
    tok = processor.tokenizer
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert c.tool_calls == 1 and c.turns == 2
    context = [t for t, m in zip(c.token_ids, c.mask, strict=True) if not m]
    n_image_tokens = context.count(image_pad)
    assert n_image_tokens > 1  # the placeholder was expanded into the image's tokens
    # the second turn was generated with the image: its patches and grid went to generate
    assert "pixel_values" not in calls[0]
    assert calls[1]["image_grid_thw"].shape == (1, 3)
    assert int(calls[1]["mm_token_type_ids"].sum()) == n_image_tokens
    # the tool message as the reward functions see it holds the image part
    tool_message = next(m for m in c.messages if m["role"] == "tool")
    assert tool_message["content"][0] == {"type": "image"}
    # the update's prompt carries the tool's image and where its tokens are in the completion
    prompt = c.context_inputs.training_prompt(prompt_ids)
    assert isinstance(prompt, VisionSequence) and list(prompt) == prompt_ids and prompt.num_images == 1
    assert [c.token_ids[k] for k in prompt.completion_image_positions] == [image_pad] * n_image_tokens
    model.train()
    red = vision_packed_logprobs(model, [(prompt, c.token_ids)], attn="native").logprobs
    red[-2].backward()  # "blue", after the image
    vision = [p.grad for n, p in inner_model(model).named_parameters() if "visual" in n or "vision" in n]
    assert any(g is not None and bool(g.abs().sum() > 0) for g in vision)  # the tool's image is in the forward

    model_b, _, _, prompt_ids_b, c_b = _conversation(family, "blue")
    assert c_b.token_ids == c.token_ids  # the same tokens, another image behind the image tokens
    blue = vision_packed_logprobs(model_b, [(c_b.context_inputs.training_prompt(prompt_ids_b), c_b.token_ids)],
                                  attn="native").logprobs
    after = [k for k, m in enumerate(c.mask) if m][-2:]  # the model's last turn reads the image
    assert not torch.allclose(red.detach()[after], blue.detach()[after])


def test_a_text_model_is_told_of_the_images_it_cannot_see():
    result = ToolResult("screenshot", "the image", images=("IMG",), parts=(("image", 0), ("text", "the image")))
    text_model = tool_result_messages([result])
    assert text_model[0]["content"] == "the image\n[1 image(s) returned by the tool; this model reads text only]"
    vlm = tool_result_messages([result], with_images=True)
    assert vlm[0]["content"] == [{"type": "image"}, {"type": "text", "text": "the image"}]

"""Vision-language models whose language model is more than embeddings + attention layers: Gemma 4 (per-layer
token embeddings, `per_layer_inputs`, which `inputs_embeds` alone cannot give) and Qwen3.5 (linear-attention
layers carrying a recurrent state along the sequence), on tiny random models built offline.

- the packed training forward gives the logprobs of an ordinary Hugging Face forward of each sequence: Gemma 4
  gets its per-layer inputs from the row's token ids; Qwen3.5 runs one sequence per forward, since a state
  must not flow from one sequence of a packed row into the next;
- VisionGroupEngine's greedy output equals `generate` (the prompt's cache, recurrent states included, is
  gathered into G rows per prompt, then shrinks as completions finish).
The tiny Gemma 4's first layer has a sliding window (64) shorter than its prompts with images (76 tokens).
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_vlms import build, solid

from cohort.forward.packing import packed_forward_logprobs
from cohort.types import SamplingParams
from cohort.vision import VisionGroupEngine, encode_vision_prompt
from cohort.vision.model import image_token_id

FAMILIES = ["gemma4", "qwen3_5"]


def _prompts(processor):
    question = [{"role": "user", "content": "what colour is this ?"}]
    return [
        encode_vision_prompt(processor, question, [solid("red")], "test", 0),
        encode_vision_prompt(processor, question, [solid("blue", 56)], "test", 1),
        encode_vision_prompt(processor, [{"role": "user", "content": "is the sky blue ?"}], [], "test", 2),
    ]


def _vision_kwargs(model, ids, prompt) -> dict:
    kwargs = dict(prompt.vision_inputs())
    if kwargs:
        kwargs["mm_token_type_ids"] = (ids == image_token_id(model)).long()
    return kwargs


def _hf_logprobs(model, prompt, completion):
    """log p(completion | prompt, images) from one ordinary forward of the whole model over prompt + completion."""
    ids = torch.tensor([list(prompt) + list(completion)])
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    logits = model(input_ids=ids, **_vision_kwargs(model, ids, prompt)).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    p = len(prompt)
    return logp[p - 1:p - 1 + len(completion)].gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["varlen", "native"])
def test_packed_logprobs_match_the_models_own_forward(family, attn):
    model, processor = build(family)
    prompts = _prompts(processor)
    words = processor.tokenizer.convert_tokens_to_ids(["red", "green", "blue", "the", "sky"])
    sequences = [(prompts[0], words[:3]), (prompts[1], words[2:]), (prompts[2], words[1:4]), (prompts[0], [words[4]])]
    with torch.no_grad():
        packed = packed_forward_logprobs(model, sequences, attn=attn, chunk_tokens=3)
        want = [_hf_logprobs(model, p, c) for p, c in sequences]
    for (got, _), ref in zip(packed.split(), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_of_the_language_model_gets_a_gradient(family):
    model, processor = build(family)
    model.train()
    red = processor.tokenizer.convert_tokens_to_ids("red")
    packed = packed_forward_logprobs(model, [(p, [red, red]) for p in _prompts(processor)])
    packed.logprobs.sum().backward()
    body = model.model.language_model
    missing = [n for n, p in body.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing  # Gemma 4's per-layer embedding table and projection included


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rollouts_equal_generate(family):
    # a seed whose greedy completions hold no image/audio/video placeholder: transformers' Gemma 4 reads such a
    # generated token as padding, cohort (as transformers' Qwen models) as an ordinary token
    model, processor = build(family, seed=19 if family == "gemma4" else 3)
    prompts = _prompts(processor)
    eos = processor.tokenizer.eos_token_id
    engine = VisionGroupEngine(model, processor.tokenizer, eos_token_ids=[eos])
    groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=5, temperature=0.0))
    assert engine.stats.prefills == len(prompts)
    for prompt, group in zip(prompts, groups, strict=True):
        ids = torch.tensor([list(prompt)])
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **_vision_kwargs(model, ids, prompt),
                             do_sample=False, max_new_tokens=5, eos_token_id=eos,
                             pad_token_id=processor.tokenizer.pad_token_id)
        want = out[0, ids.shape[1]:].tolist()
        if eos in want:
            want = want[:want.index(eos) + 1]
        assert [c.token_ids for c in group] == [want, want]
        with torch.no_grad():
            ref = _hf_logprobs(model, prompt, group[0].token_ids)
        torch.testing.assert_close(torch.tensor(group[0].logprobs), ref, atol=1e-4, rtol=1e-4)

"""Vision-language models (issue 17) on tiny random Qwen2-VL and Idefics3 models built offline.

- the packed training forward (several prompts with images in one row, varlen and native attention) gives
  the logprobs of an unpacked Hugging Face forward of each sequence;
- image tokens get no gradient (they are context); the vision tower does, unless frozen;
- VisionGroupEngine's greedy output equals `generate`, with one vision pass and one prefill per group;
- sampling is seeded per completion.
"""

from __future__ import annotations

import pytest
import torch
from tests.helpers.tiny_vlms import build, solid

from cohort.forward.packing import packed_forward_logprobs
from cohort.types import SamplingParams
from cohort.vision import VisionGroupEngine, encode_vision_prompt
from cohort.vision.model import image_token_id

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "idefics3"]


def _prompts(processor):
    question = [{"role": "user", "content": "what colour is this ?"}]
    two = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                        {"type": "text", "text": "what colour ?"}]}]
    return [
        encode_vision_prompt(processor, question, [solid("red")], "test", 0),
        encode_vision_prompt(processor, question, [solid("blue", 56)], "test", 1),
        encode_vision_prompt(processor, two, [solid("green"), solid("red")], "test", 2),
        encode_vision_prompt(processor, [{"role": "user", "content": "is the sky blue ?"}], [], "test", 3),
    ]


def _hf_logprobs(model, prompt, completion):
    """log p(completion | prompt, images) from ordinary forwards of the whole model: the prompt (images
    merged by the model itself), then the completion on its KV cache (a generated image token is text)."""
    ids = torch.tensor([list(prompt)])
    kwargs = dict(prompt.vision_inputs())
    if "image_grid_thw" in kwargs:
        kwargs["mm_token_type_ids"] = (ids == image_token_id(model)).long()
    if hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    out = model(input_ids=ids, **kwargs, use_cache=True)
    logits = out.logits[0].float()
    if len(completion) > 1:
        rest = torch.tensor([list(completion[:-1])])
        # transformers >= 5.2x names the cache `cache`, 5.17 `past_key_values` (as VisionGroupEngine)
        arg = "cache" if hasattr(out, "cache") else "past_key_values"
        more = model(input_ids=rest, use_cache=True, **{arg: getattr(out, arg)}).logits[0].float()
        logits = torch.cat([logits, more])
    logp = torch.log_softmax(logits, -1)
    p = len(prompt)
    return logp[p - 1:p - 1 + len(completion)].gather(-1, torch.tensor(completion)[:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["varlen", "native"])
def test_packed_logprobs_match_unpacked_forward(family, attn):
    model, processor = build(family)
    prompts = _prompts(processor)
    gen = torch.Generator().manual_seed(1)
    words = processor.tokenizer.convert_tokens_to_ids(["red", "green", "blue", "the", "sky"])
    completions = [[words[int(i)] for i in torch.randint(0, 5, (n,), generator=gen)] for n in (5, 3, 7, 4)]
    # the first prompt twice (the vision tower runs once for both) and a completion of one token
    sequences = [*list(zip(prompts, completions)), (prompts[0], completions[1]), (prompts[1], [words[0]])]
    # a completion holding the image token: generated, it is an ordinary token (as in generate)
    sequences.append((prompts[2], [words[1], image_token_id(model), words[2]]))
    with torch.no_grad():
        packed = packed_forward_logprobs(model, sequences, attn=attn, chunk_tokens=3)
        want = [_hf_logprobs(model, p, c) for p, c in sequences]
    for (got, _), ref in zip(packed.split(), want):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_tokens_get_no_gradient_and_the_vision_tower_does(family):
    model, processor = build(family)
    model.train()
    prompts = _prompts(processor)
    red = processor.tokenizer.convert_tokens_to_ids("red")
    packed = packed_forward_logprobs(model, [(p, [red, red]) for p in prompts])
    packed.logprobs.sum().backward()
    embed = model.get_input_embeddings().weight.grad
    assert embed is not None and embed.abs().sum() > 0
    assert torch.count_nonzero(embed[image_token_id(model)]) == 0  # context: replaced by image features
    vision = [p for n, p in model.named_parameters() if "visual" in n or "vision_model" in n]
    assert vision and any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rollouts_equal_generate_with_one_prefill_per_group(family):
    model, processor = build(family, seed=3)
    prompts = _prompts(processor)
    eos = processor.tokenizer.eos_token_id
    engine = VisionGroupEngine(model, processor.tokenizer, eos_token_ids=[eos])
    groups = engine.generate(prompts, SamplingParams(n=3, max_tokens=6, temperature=0.0))
    assert engine.stats.prefills == len(prompts)  # one prefill per group of 3
    assert engine.stats.vision_passes == 3  # the three prompts with images, once each
    for prompt, group in zip(prompts, groups):
        ids = torch.tensor([list(prompt)])
        kwargs = dict(prompt.vision_inputs())
        if "image_grid_thw" in kwargs:
            kwargs["mm_token_type_ids"] = (ids == image_token_id(model)).long()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs, do_sample=False,
                             max_new_tokens=6, eos_token_id=eos, pad_token_id=processor.tokenizer.pad_token_id)
        want = out[0, ids.shape[1]:].tolist()
        if eos in want:
            want = want[:want.index(eos) + 1]
        for c in group:
            assert c.token_ids == want
            assert len(c.logprobs) == len(want) and all(lp <= 0 for lp in c.logprobs)
        # the reported logprobs are the trainer's (temperature 1 when greedy)
        with torch.no_grad():
            ref = _hf_logprobs(model, prompt, group[0].token_ids)
        torch.testing.assert_close(torch.tensor(group[0].logprobs), ref, atol=1e-4, rtol=1e-4)


def test_sampling_is_seeded_per_completion():
    model, processor = build("qwen2_vl", seed=5)
    prompts = _prompts(processor)[:2]
    engine = VisionGroupEngine(model, processor.tokenizer, eos_token_ids=[processor.tokenizer.eos_token_id])
    params = SamplingParams(n=4, max_tokens=5, temperature=1.0, seed=11)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert len({tuple(c.token_ids) for g in a for c in g}) > 1  # the completions differ from each other


def _count_vision_passes(model):
    """Wrap the inner model's get_image_features to count its calls."""
    inner = model.model
    original = inner.get_image_features
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    inner.get_image_features = counted
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_engine_runs_vlms_like_generate_with_one_prefill_and_vision_pass_per_group(family):
    from cohort.engine import CohortEngine, engine_supports

    model, processor = build(family, seed=3)
    assert engine_supports(model) == (True, "ok")
    prompts = _prompts(processor)
    eos = processor.tokenizer.eos_token_id
    engine = CohortEngine(model, processor.tokenizer, eos_token_ids=[eos], max_model_len=128)
    reference = VisionGroupEngine(model, processor.tokenizer, eos_token_ids=[eos])
    calls = _count_vision_passes(model)
    greedy = engine.generate(prompts, SamplingParams(n=3, max_tokens=8, temperature=0.0))
    # every prompt prefilled once (its G completions share the prompt's KV blocks), images encoded once
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)
    assert len(calls) == 3
    want = reference.generate(prompts, SamplingParams(n=1, max_tokens=8, temperature=0.0))
    assert [[c.token_ids for c in g] for g in greedy] == [[w[0].token_ids] * 3 for w in want]  # = generate (above)
    # sampling: the same seeded tokens and logprobs as the vision group engine
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, top_k=20, seed=9)
    a, b = engine.generate(prompts, params), reference.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga, gb):
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5, rtol=1e-5)


def test_paged_engine_recomputes_a_preempted_vlm_sequence_exactly():
    from cohort.engine import CohortEngine

    model, processor = build("qwen2_vl", seed=3)
    prompts = _prompts(processor)
    eos = processor.tokenizer.eos_token_id
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=2, ignore_eos=True)
    roomy = CohortEngine(model, processor.tokenizer, eos_token_ids=[eos], max_model_len=64, block_size=4)
    tight = CohortEngine(model, processor.tokenizer, eos_token_ids=[eos], max_model_len=64, block_size=4,
                         num_kv_blocks=24)
    a, b = roomy.generate(prompts, params), tight.generate(prompts, params)
    assert tight.stats.prefill_tokens > roomy.stats.prefill_tokens  # preempted sequences were recomputed
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]


def test_paged_engine_refuses_to_continue_a_conversation_with_images():
    from cohort.engine import CohortEngine

    model, processor = build("qwen2_vl", seed=3)
    prompts = _prompts(processor)[:1]
    eos = processor.tokenizer.eos_token_id
    engine = CohortEngine(model, processor.tokenizer, eos_token_ids=[eos], max_model_len=128)
    words = processor.tokenizer.convert_tokens_to_ids(["the", "sky"])
    params = SamplingParams(n=1, max_tokens=20, temperature=0.0)  # the first turn ends on EOS
    with pytest.raises(ValueError, match="continuing a conversation with images is not supported"):
        engine.generate_turns(prompts, params, lambda end: words)

"""CUDA checks of the VLM paths (issue 17): the packed forward with images on the flash varlen kernel (bf16)
against an fp32 HF forward, and the vision engine's greedy rollouts against `generate` on the GPU."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from tests.helpers.tiny_vlms import build, solid

from cohort.forward.packing import packed_forward_logprobs
from cohort.types import SamplingParams
from cohort.vision import VisionGroupEngine, encode_vision_prompt
from cohort.vision.model import image_token_id

QUESTION = [{"role": "user", "content": "what colour is this ?"}]


def _prompts(processor):
    return [encode_vision_prompt(processor, QUESTION, [solid(c)], "gpu", i) for i, c in enumerate(("red", "blue"))]


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_bf16_varlen_packed_logprobs_match_fp32_forward(family):
    model, processor = build(family, hidden=64)
    prompts = _prompts(processor)
    words = processor.tokenizer.convert_tokens_to_ids(["red", "green", "blue", "the"])
    sequences = [(prompts[0], words), (prompts[1], words[:2]), (prompts[0], words[::-1])]
    ref = model.to("cuda", torch.float32)
    with torch.no_grad():
        want = []
        for p, c in sequences:
            ids = torch.tensor([list(p) + c], device="cuda")
            kwargs = dict(p.vision_inputs("cuda"))
            if "image_grid_thw" in kwargs:
                kwargs["mm_token_type_ids"] = (ids == image_token_id(ref)).long()
            logp = torch.log_softmax(ref(input_ids=ids, **kwargs).logits[0].float(), -1)
            want.append(logp[len(p) - 1:len(p) - 1 + len(c)].gather(-1, torch.tensor(c, device="cuda")[:, None])[:, 0])
        got = packed_forward_logprobs(ref.to(torch.bfloat16), sequences)
    for (lp, _), w in zip(got.split(), want):
        torch.testing.assert_close(lp, w, atol=0.1, rtol=0.05)


def test_vision_engine_greedy_equals_generate_on_cuda():
    model, processor = build("qwen2_vl", seed=3)
    model = model.to("cuda")
    prompts = _prompts(processor)
    eos = processor.tokenizer.eos_token_id
    engine = VisionGroupEngine(model, processor.tokenizer, eos_token_ids=[eos])
    groups = engine.generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=0.0))
    assert engine.stats.prefills == 2
    for prompt, group in zip(prompts, groups):
        ids = torch.tensor([list(prompt)], device="cuda")
        kwargs = dict(prompt.vision_inputs("cuda"))
        kwargs["mm_token_type_ids"] = (ids == image_token_id(model)).long()
        model.model.rope_deltas = None
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs, do_sample=False,
                             max_new_tokens=6, eos_token_id=eos, pad_token_id=processor.tokenizer.pad_token_id)
        want = out[0, ids.shape[1]:].tolist()
        want = want[:want.index(eos) + 1] if eos in want else want
        assert all(c.token_ids == want for c in group)


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_paged_engine_with_cuda_graphs_matches_the_group_engine(family):
    from cohort.engine import CohortEngine

    model, processor = build(family, seed=3)
    model = model.to("cuda")
    prompts = _prompts(processor)
    eos = processor.tokenizer.eos_token_id
    paged = CohortEngine(model, processor.tokenizer, eos_token_ids=[eos], max_model_len=128, max_num_seqs=16)
    assert paged.runner.graphs  # decode replays CUDA graphs; the rope delta rides in the position row
    group = VisionGroupEngine(model, processor.tokenizer, eos_token_ids=[eos])
    for params in (SamplingParams(n=3, max_tokens=8, temperature=0.0),
                   SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=4)):
        a, b = paged.generate(prompts, params), group.generate(prompts, params)
        assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]

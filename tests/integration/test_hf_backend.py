"""HFGenerateEngine on a tiny Llama with a real (tiny BPE) tokenizer: shapes, stops, logprobs, seeds."""

import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from cohort.engine.hf_backend import HFGenerateEngine
from cohort.forward.packing import packed_forward_logprobs
from cohort.types import RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode("What is 2 + 3?"), tok.encode("12 +"), tok.encode("the quick brown fox jumps")]


def test_protocol_shapes_and_finish_reasons(model, tok, prompts):
    engine = HFGenerateEngine(model, tok, batch_size=5)
    assert isinstance(engine, RolloutEngine)
    out = engine.generate(prompts, SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=1))
    assert len(out) == 3 and all(len(group) == 3 for group in out)
    for group in out:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            assert all(lp <= 0 for lp in c.logprobs)
            if c.finish_reason == "length":
                assert len(c.token_ids) == 6 and tok.eos_token_id not in c.token_ids
            else:
                assert c.token_ids[-1] == tok.eos_token_id and tok.eos_token_id not in c.token_ids[:-1]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_equal_recomputed(model, tok, prompts, temperature):
    engine = HFGenerateEngine(model, tok)
    params = SamplingParams(n=2, max_tokens=7, temperature=temperature, top_k=20, seed=3)
    out = engine.generate(prompts, params)
    seqs = [(p, c.token_ids) for p, group in zip(prompts, out) for c in group]
    with torch.no_grad():
        ref = packed_forward_logprobs(model, seqs, temperature=params.logprob_temperature, compute_entropy=False)
    got = torch.tensor([lp for group in out for c in group for lp in c.logprobs])
    torch.testing.assert_close(got, ref.logprobs, rtol=1e-4, atol=1e-4)


def test_greedy_is_deterministic_and_argmax(model, tok, prompts):
    engine = HFGenerateEngine(model, tok, batch_size=2)
    params = SamplingParams(n=2, max_tokens=6, temperature=0.0)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    assert a[0][0].token_ids == a[0][1].token_ids
    ids = list(prompts[1])  # hand-rolled argmax decoding of one prompt
    with torch.no_grad():
        for _ in range(len(a[1][0].token_ids)):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompts[1]) :] == a[1][0].token_ids


def test_seeds(model, tok, prompts):
    engine = HFGenerateEngine(model, tok, batch_size=1)
    params = SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=11)
    a = engine.generate(prompts, params)
    assert [c.token_ids for g in a for c in g] == [c.token_ids for g in engine.generate(prompts, params) for c in g]
    # batch_size=1: completion j of prompt i uses seed + i * n + j, whatever else is in the request.
    alone = engine.generate([prompts[2]], SamplingParams(n=1, max_tokens=8, temperature=1.0, seed=11 + 2 * 2 + 1))
    assert alone[0][0].token_ids == a[2][1].token_ids
    other = engine.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=12))
    assert [c.token_ids for g in a for c in g] != [c.token_ids for g in other for c in g]


def test_trainer_rng_untouched_and_mode_restored(model, tok, prompts):
    model.train()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    HFGenerateEngine(model, tok).generate(prompts, SamplingParams(max_tokens=3, seed=5))
    assert torch.equal(torch.rand(3), expected)
    assert model.training
    model.eval()


def test_model_generation_defaults_do_not_leak(model, tok, prompts):
    # A generation_config with top_k=1 would make sampling greedy if generate filled our unset knobs.
    model.generation_config.top_k = 1
    try:
        out = HFGenerateEngine(model, tok).generate([prompts[0]], SamplingParams(n=6, max_tokens=5, seed=0))
    finally:
        model.generation_config.top_k = 50
    assert len({tuple(c.token_ids) for c in out[0]}) > 1


def test_eos_stop_ids_ignore_eos_and_stop_strings(model, tok, prompts):
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    ref = HFGenerateEngine(model, tok, eos_token_ids=[]).generate([prompts[0]], greedy)[0][0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 8
    stop_tok = ref.token_ids[2]
    first = ref.token_ids.index(stop_tok)
    eos_engine = HFGenerateEngine(model, tok, eos_token_ids=[stop_tok])
    c = eos_engine.generate([prompts[0]], greedy)[0][0]
    assert c.token_ids == ref.token_ids[: first + 1] and c.finish_reason == "stop"
    assert c.logprobs == pytest.approx(ref.logprobs[: first + 1], abs=1e-5)
    c = eos_engine.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0][0]
    assert c.token_ids == ref.token_ids and c.finish_reason == "length"
    c = HFGenerateEngine(model, tok, eos_token_ids=[]).generate(
        [prompts[0]], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_tok,)))[0][0]
    assert c.token_ids == ref.token_ids[: first + 1] and c.finish_reason == "stop"
    # A stop string that first appears in the text of token k: the completion ends with token k.
    texts = [tok.decode(ref.token_ids[:k]) for k in range(len(ref.token_ids) + 1)]
    k, stop = next((k, texts[k][-1]) for k in range(2, 9) if texts[k][-1] != "\ufffd" and texts[k][-1] not in texts[k - 1])
    c = HFGenerateEngine(model, tok, eos_token_ids=[]).generate(
        [prompts[0]], SamplingParams(max_tokens=8, temperature=0.0, stop_strings=(stop,)))[0][0]
    assert c.finish_reason == "stop" and c.token_ids == ref.token_ids[:k]


def test_bad_arguments(model, tok):
    with pytest.raises(ValueError, match="batch_size"):
        HFGenerateEngine(model, tok, batch_size=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        HFGenerateEngine(model, tok).generate([[]], SamplingParams())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_beam_search_through_hf_generate_kwargs(model, tok, prompts, temperature):
    """generation.hf_generate_kwargs reach generate: the rows equal transformers' own beam search (sampling or
    not) under the same seed, and their logprobs, recomputed by a forward, equal the packed trainer pass."""
    kwargs = {"num_beams": 3, "length_penalty": -0.1}
    engine = HFGenerateEngine(model, tok, generate_kwargs=kwargs, batch_size=1)
    params = SamplingParams(n=2, max_tokens=6, temperature=temperature, seed=4)
    out = engine.generate(prompts, params)
    sampling = {} if temperature == 0 else {"temperature": temperature, "top_k": 0}
    for i, p in enumerate(prompts):
        for j, c in enumerate(out[i]):
            torch.manual_seed(4 + i * 2 + j)
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=temperature > 0, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id, **sampling, **kwargs)[0, len(p):].tolist()
            assert c.token_ids == ref[: len(c.token_ids)]
    plain = HFGenerateEngine(model, tok).generate(prompts, SamplingParams(n=2, max_tokens=6, temperature=0.0))
    if temperature == 0:  # the beams take effect: beam search finds other rows than greedy decoding here
        assert [c.token_ids for g in out for c in g] != [c.token_ids for g in plain for c in g]
    seqs = [(p, c.token_ids) for p, group in zip(prompts, out) for c in group]
    with torch.no_grad():
        ref_lp = packed_forward_logprobs(model, seqs, temperature=params.logprob_temperature, compute_entropy=False)
    got = torch.tensor([lp for group in out for c in group for lp in c.logprobs])
    torch.testing.assert_close(got, ref_lp.logprobs, rtol=1e-4, atol=1e-4)


def test_a_generate_replaced_on_the_model_samples_and_regenerates_in_one_batch(model, tok, prompts):
    """A model whose `generate` is replaced on the instance (a user's wrapper, a scripted stand-in such as TRL's
    tests patch in) samples through it: build_engine picks the generate path, the replacement may return bare
    sequences, the conversations that continue after tool results are regenerated in one call (as TRL does),
    and the logprobs come from a forward."""
    from cohort.config import CohortConfig
    from cohort.setup.engine import build_engine

    eos = tok.eos_token_id
    calls = []

    def scripted(input_ids, **kwargs):
        calls.append(input_ids.shape[0])
        if len(calls) == 1:  # three first turns: two end on EOS and ask for a tool, one ends without EOS
            tail = torch.tensor([[5, 6, eos], [7, eos, tok.pad_token_id], [8, 9, 10]])
        else:  # the two continuations, in one batch
            tail = torch.tensor([[11, eos], [12, eos]])
        return torch.cat([input_ids, tail.to(input_ids.device)], dim=-1)

    model.generate = scripted
    try:
        engine = build_engine(CohortConfig(), model, tok, torch.device("cpu"), echo=lambda *_: None)
        assert isinstance(engine, HFGenerateEngine)
        out = engine.generate_turns([prompts[0]], SamplingParams(n=3, max_tokens=8, temperature=1.0),
                                    lambda end: [20, 21] if end.turn == 1 else None)
    finally:
        del model.generate
    assert calls == [3, 2]
    assert [c.token_ids for c in out[0]] == [[5, 6, eos, 20, 21, 11, eos], [7, eos, 20, 21, 12, eos], [8, 9, 10]]
    assert out[0][0].mask == [1, 1, 1, 0, 0, 1, 1]
    first = out[0][2]
    with torch.no_grad():
        ref = packed_forward_logprobs(model, [(prompts[0], first.token_ids)], compute_entropy=False)
    torch.testing.assert_close(torch.tensor(first.logprobs), ref.logprobs, rtol=1e-4, atol=1e-4)


def test_only_a_generate_that_is_not_transformers_or_peft_counts_as_replaced(model):
    """cohort's engine stays for transformers' and peft's own generate (a LoRA policy); a generate patched on
    the class (as TRL's tests patch GenerationMixin.generate) or a subclass's override is the user's."""
    from unittest.mock import patch

    from peft import LoraConfig, get_peft_model

    from cohort.setup.engine import generate_replaced

    assert not generate_replaced(model)
    lora = get_peft_model(LlamaForCausalLM(model.config), LoraConfig(r=2, target_modules=["q_proj"]))
    assert not generate_replaced(lora)
    with patch("transformers.generation.utils.GenerationMixin.generate"):
        assert generate_replaced(model)

    class Constrained(LlamaForCausalLM):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    assert generate_replaced(Constrained(model.config))


def test_prompts_with_images_reach_generate_with_their_tensors(model, tok, prompts, monkeypatch):
    class WithImage(list):  # a prompt that carries model inputs besides its ids (cohort.types.PromptWithInputs)
        num_images = 1

        def model_inputs(self, device=None):
            return {"pixel_values": torch.ones(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}

    seen: dict = {}

    def scripted(input_ids, **kwargs):  # a generate that records what it was given
        seen.update(kwargs, rows=input_ids.shape[0])
        return torch.cat([input_ids, torch.full((input_ids.shape[0], 2), 5)], dim=-1)

    engine = HFGenerateEngine(model, tok)
    monkeypatch.setattr(model, "generate", scripted, raising=False)
    monkeypatch.setattr(engine, "_forward_logprobs", lambda seqs, *a: torch.zeros(seqs.shape[0], 2))
    engine.generate([prompts[0], WithImage(prompts[1])], SamplingParams(n=2, max_tokens=2))
    assert seen["rows"] == 4
    # prompt 1's patches and grid once per row that holds it (its two completions), in row order
    assert seen["pixel_values"].shape == (8, 3)
    assert seen["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    seen.clear()
    engine.generate([prompts[0]], SamplingParams(n=1, max_tokens=2))  # no images: nothing extra
    assert "pixel_values" not in seen

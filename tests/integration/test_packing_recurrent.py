"""Models with recurrent layers (Mamba in NemotronH): a packed row would let one sequence's state flow into the
next, so the packed forward refuses several of their sequences in one row, and the update gives each its own
micro-batch; one sequence per forward equals the model's own forward of that sequence."""

from __future__ import annotations

import pytest
import torch
from tests.integration.engine_models import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from cohort.forward.packing import packed_forward_logprobs
from cohort.forward.recurrent import has_recurrent_layers, one_sequence_per_row

SEQUENCES = [([1, 5, 7, 9], [3, 4, 6]), ([2, 8], [10, 11, 12, 13])]


def _nemotron_h():
    torch.manual_seed(0)
    config = AutoConfig.for_model("nemotron_h", vocab_size=64, hidden_size=32, num_attention_heads=4,
                                  num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64)
    return AutoModelForCausalLM.from_config(config).eval()


def _own_forward(model, prompt, completion):
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_recurrent_models_are_recognised():
    assert has_recurrent_layers(_nemotron_h())
    assert not has_recurrent_layers(tiny_model("qwen3_moe")) and not has_recurrent_layers(tiny_model("gemma3"))


def test_a_packed_row_of_recurrent_sequences_is_refused_and_one_each_is_exact():
    model = _nemotron_h()
    with torch.no_grad(), pytest.raises(ValueError, match="recurrent layers"):
        packed_forward_logprobs(model, SEQUENCES, compute_entropy=False)
    with torch.no_grad():
        for prompt, completion in SEQUENCES:
            got = packed_forward_logprobs(model, [(prompt, completion)], compute_entropy=False).logprobs
            torch.testing.assert_close(got, _own_forward(model, prompt, completion), atol=1e-5, rtol=1e-5)


def test_the_update_gives_each_sequence_its_own_micro_batch():
    from types import SimpleNamespace

    from cohort.update import PolicyUpdater

    batch = SimpleNamespace(prompt_ids=[[1, 2], [1, 2], [3]], completion_ids=[[4], [5, 6], [7]])
    settings = SimpleNamespace(share_prompts=True, token_budget=10_000, sharded=False)
    with pytest.warns(UserWarning, match="one sequence"):
        one_each = PolicyUpdater._micro_batches(SimpleNamespace(policy=_nemotron_h(), s=settings), batch, [0, 1, 2])
    assert one_each == [[0], [1], [2]]
    packed = PolicyUpdater._micro_batches(SimpleNamespace(policy=tiny_model("llama"), s=settings), batch, [0, 1, 2])
    assert packed == [[0, 1, 2]]
    assert not one_sequence_per_row(tiny_model("llama"))

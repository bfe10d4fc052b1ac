"""A push carries the trainer's floating buffers (RoPE frequencies) too: a policy cast with .to(bfloat16) has
bf16-rounded `rotary_emb.inv_freq`, a served model loaded in bf16 keeps float32 ones, and with parameters alone
the served greedy tokens differed from the trainer's in-process engine (tests/gpu/test_serving_gpu.py on two
H100s: from the 4th token on, after a perturbation). In process on the CPU, bf16, as EngineServer applies a push."""

from __future__ import annotations

import threading

import pytest
import torch
from tests.helpers.toy_task import tiny_model, write_toy_workspace

from cohort.engine import CohortEngine
from cohort.policy.model import load_policy
from cohort.remote import weights as W
from cohort.serving.engine_server import EngineServer, Replica, _Push
from cohort.setup.engine import eos_ids
from cohort.types import SamplingParams

GREEDY = SamplingParams(n=2, max_tokens=16, temperature=0.0)


def _tokens(groups) -> list[list[int]]:
    return [c.token_ids for g in groups for c in g]


def _push(server: EngineServer, policy: torch.nn.Module, version: int) -> None:
    """What /weights/begin checks and /weights/commit applies, without the process group."""
    named = W.model_tensors(policy)
    specs = W.manifest_of(named)
    W.check_manifest(specs, server.specs, server.castable)
    done = threading.Thread(target=lambda: None)
    done.start()
    staged = {n: t.detach().clone() for n, t in named}
    server._push = _Push(version=version, specs=specs, thread=done, staged=staged)
    server.weights_commit(version)


# seeds whose perturbation gave other served tokens when only parameters were pushed (7 of them in 0..40)
@pytest.mark.parametrize("seed", [7, 24, 31])
def test_a_bf16_cast_policy_is_served_with_its_own_rope_frequencies(tmp_path, seed):
    model_dir, _ = write_toy_workspace(tmp_path)
    served_model, tok = load_policy(str(model_dir), dtype=torch.bfloat16)
    assert served_model.model.rotary_emb.inv_freq.dtype == torch.float32  # from_pretrained keeps them float32
    policy = tiny_model(tok, seed=5).to(dtype=torch.bfloat16)  # casts the frequencies as well
    assert policy.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    eos = eos_ids(tok, policy)
    engine = CohortEngine(served_model, tok, eos_token_ids=eos)
    server = EngineServer([Replica(served_model, engine, torch.device("cpu"), threading.Lock())], tok,
                          model_name="m")
    assert "model.rotary_emb.inv_freq" in {s.name for s in server.specs}
    prompts = [tok(t)["input_ids"] for t in ("Say the digit 3", "What is 2 + 3?")]
    local = CohortEngine(policy, tok, eos_token_ids=eos)
    _push(server, policy, 0)
    assert _tokens(server.generate(prompts, GREEDY)[0]) == _tokens(local.generate(prompts, GREEDY))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn_like(p))
    _push(server, policy, 1)
    local.sync_weights()
    # the served model rotates with the trainer's (bf16-rounded) frequencies, kept in its own float32 buffer
    assert torch.equal(served_model.model.rotary_emb.inv_freq, policy.model.rotary_emb.inv_freq.float())
    assert torch.equal(engine.runner.net.cos, local.runner.net.cos)
    groups, version = server.generate(prompts, GREEDY)
    assert version == 1 and _tokens(groups) == _tokens(local.generate(prompts, GREEDY))


def test_buffers_may_come_in_another_float_dtype_but_parameters_may_not():
    served = W.manifest_of([("w", torch.zeros(2, 3)), ("rotary.inv_freq", torch.zeros(4))])
    W.check_manifest(W.manifest_of([("w", torch.zeros(2, 3)), ("rotary.inv_freq", torch.zeros(4).bfloat16())]),
                     served, castable={"rotary.inv_freq"})
    with pytest.raises(W.WeightMismatchError, match="'w' is bfloat16 in the push but float32"):
        W.check_manifest(W.manifest_of([("w", torch.zeros(2, 3).bfloat16()), ("rotary.inv_freq", torch.zeros(4))]),
                         served, castable={"rotary.inv_freq"})
    with pytest.raises(W.WeightMismatchError, match="int64 in the push"):  # a cast only between float dtypes
        W.check_manifest(W.manifest_of([("w", torch.zeros(2, 3)), ("rotary.inv_freq", torch.zeros(4).long())]),
                         served, castable={"rotary.inv_freq"})

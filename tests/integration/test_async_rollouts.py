"""Asynchronous rollouts on the colocated engine (train.async_rollouts, cohort.streaming), on the CPU.

- every sampled token records the policy version that sampled it, and the loss's sampler importance weights
  correct each token with its own sampling logprob (stale tokens get exp(logp_now - logp_then));
- a partial rollout that straddles a weight update: its first part is exactly what the old weights generate
  alone; its second part is exactly the new weights' continuation over the old weights' KV of the first part
  (a teacher-forced Hugging Face reference built that way), and not what a fresh prefill with the new weights
  gives (the KV of the first part is not recomputed);
- staleness 0 (async_rollouts with max_staleness=0) is the synchronous run exactly, metrics and weights;
- steps take groups in the order they finish, whole groups of G, and wait for a group at its staleness bound.
"""

from __future__ import annotations

import inspect
import os
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers.gloo_ranks import enter_rank, leave_rank
from tests.integration.engine_models import EOS, random_prompts, tiny_model
from tests.integration.test_token_mask import _Capture, _no_timer
from tests.integration.test_trainer_learns import toy_components, toy_config

import cohort.trainer
from cohort.algorithms import build_policy_loss
from cohort.engine import CohortEngine
from cohort.engine.streaming import EngineStream
from cohort.errors import ConfigError
from cohort.rollout import RolloutBatch
from cohort.run.logging import read_jsonl
from cohort.streaming import StreamingRollouts
from cohort.trainer import train
from cohort.types import SamplingParams
from cohort.update import PolicyUpdater, UpdateSettings


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _perturbed(model, scale: float = 0.08, seed: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v.detach() + scale * torch.randn(v.shape, generator=gen).to(v.device)
            for k, v in model.named_parameters()}


def _ids(model, ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], device=model.device)


def _load(model, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(weights[k])


def _engine(model, **kw) -> CohortEngine:
    return CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=128, **kw)


def _straddle(model, a, b, params: SamplingParams, prompt: list[int], switch_after: int,
              decode_steps: int | None = 1):
    """Stream `params.n` completions of `prompt`: weights `a` until the first has `switch_after` tokens, then `b`."""
    _load(model, a)
    engine = _engine(model, decode_steps=decode_steps)
    stream = EngineStream(engine)
    group = stream.admit(prompt, params)
    stream.run(lambda: group.seqs[0].num_completion_tokens >= switch_after)
    _load(model, b)  # the optimizer step, in place
    engine.sync_weights()
    stream.version = 1
    stream.run(lambda: group.finished_at is not None)
    return stream.take([group])[0]


def _forward(model, ids, past=None, use_cache=True):
    """One forward with a KV cache, under either name transformers gives it (`cache` from 5.2x,
    `past_key_values` before): the GPU image's transformers is older than CI's."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids, use_cache=use_cache, **({name: past} if past is not None else {}))
    return out, getattr(out, name, None)


def _mixed_kv_continuation(model, a, b, prompt: list[int], part1: list[int], count: int):
    """Greedy continuation with `b` over the KV that `a` computed for prompt + part1[:-1] (the engine's state at
    the switch: the last sampled token is fed to the next step, with the new weights)."""
    _load(model, a)
    with torch.no_grad():
        _, past = _forward(model, _ids(model, prompt + part1[:-1]))
        _load(model, b)
        token, tokens, logprobs = part1[-1], [], []
        for _ in range(count):
            out, past = _forward(model, _ids(model, [token]), past)
            logp = out.logits[0, -1].float().log_softmax(-1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
    return tokens, logprobs


def _mixed_kv_logprobs(model, a, b, prompt: list[int], completion: list[int], cut: int) -> list[float]:
    """Teacher-forced: the logprobs of completion[cut:] under `b` over the KV `a` computed for prompt +
    completion[:cut - 1]."""
    _load(model, a)
    with torch.no_grad():
        _, past = _forward(model, _ids(model, prompt + completion[:cut - 1]))
        _load(model, b)
        logits = _forward(model, _ids(model, completion[cut - 1:-1]), past, use_cache=False)[0].logits[0].float()
    return logits.log_softmax(-1).gather(-1, _ids(model, completion[cut:])[0, :, None])[:, 0].tolist()


def _fresh_logprobs(model, weights, prompt: list[int], completion: list[int]) -> list[float]:
    """The logprobs of `completion` under `weights` with every position recomputed (a fresh prefill)."""
    _load(model, weights)
    with torch.no_grad():
        logits = model(_ids(model, prompt + completion)).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, _ids(model, completion)[0, :, None])[:, 0].tolist()


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_partial_rollout_straddling_an_update_is_old_weights_then_new_weights_on_the_old_kv(decode_steps):
    check_partial_rollout(tiny_model("llama"), decode_steps)


def check_partial_rollout(model, decode_steps: int | None, total: int = 14, atol: float = 2e-5,
                          exact_part1: bool = True) -> None:
    """The straddle of the module docstring on `model` (tests/gpu reuses it on CUDA, with CUDA graphs): `total`
    tokens, the weights switched once the first 5 are in."""
    a = _weights(model)
    b = _perturbed(model)
    prompt = random_prompts([9])[0]
    params = SamplingParams(n=1, temperature=0.0, max_tokens=total, ignore_eos=True)
    (completion,) = _straddle(model, a, b, params, prompt, switch_after=5, decode_steps=decode_steps)
    versions = completion.token_versions
    assert versions is not None and len(versions) == total
    cut = versions.count(0)  # with decode_steps > 1 the launch queued before the switch still samples with `a`
    assert versions == [0] * cut + [1] * (total - cut) and 5 <= cut < total
    assert completion.version == 0  # the oldest token's
    part1, part2 = completion.token_ids[:cut], completion.token_ids[cut:]

    # part 1: exactly what the old weights generate alone (same engine code, same seeds)
    _load(model, a)
    alone = _engine(model, decode_steps=decode_steps).generate([prompt], SamplingParams(
        n=1, temperature=0.0, max_tokens=cut, ignore_eos=True))[0][0]
    assert alone.token_ids == part1
    torch.testing.assert_close(torch.tensor(alone.logprobs), torch.tensor(completion.logprobs[:cut]),
                               atol=0 if exact_part1 else atol, rtol=0)

    # part 2: the new weights' continuation over the old weights' KV of prompt + part1[:-1]
    tokens, logprobs = _mixed_kv_continuation(model, a, b, prompt, part1, total - cut)
    assert part2 == tokens
    torch.testing.assert_close(torch.tensor(completion.logprobs[cut:]), torch.tensor(logprobs), atol=atol, rtol=0)
    # ... which is not a fresh prefill of prompt + part 1 with the new weights, nor the old weights going on
    for weights in (b, a):
        fresh = _fresh_logprobs(model, weights, prompt, completion.token_ids)[cut:]
        assert (torch.tensor(completion.logprobs[cut:]) - torch.tensor(fresh)).abs().max() > 1e-3


class _Recording:
    """Wraps a loss and keeps the inputs it was called with."""

    def __init__(self, loss_fn):
        self.loss_fn, self.seen = loss_fn, []

    def __call__(self, inputs):
        self.seen.append(inputs)
        return self.loss_fn(inputs)


def test_each_token_records_its_version_and_the_correction_uses_its_own_sampling_logprob():
    model = tiny_model("llama")
    a, b = _weights(model), _perturbed(model)
    prompt = random_prompts([7])[0]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    group = _straddle(model, a, b, params, prompt, switch_after=4)
    assert all(c.token_versions == [0] * 4 + [1] * 8 for c in group)
    batch = RolloutBatch(
        prompt_ids=[prompt, prompt], completion_ids=[c.token_ids for c in group],
        sampling_logprobs=[c.logprobs for c in group], finish_reasons=["length"] * 2, completions_text=["", ""],
        prompts=["", ""], rewards_per_func=torch.zeros(2, 1), rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]), loss_mask_keep=[True, True], group_size=2,
        token_versions=[c.token_versions for c in group])
    # the trainer holds the new weights `b`; token-level truncated IS, unclipped, so every weight shows
    loss = _Recording(build_policy_loss("grpo", {"sampler_is_mode": "token_truncate", "sampler_is_clip_max": None}))
    _load(model, b)
    model.train()
    capture = _Capture(list(model.parameters()))
    settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=100_000, temperature=1.0,
                              max_grad_norm=1e9, max_completion_length=12)
    metrics = PolicyUpdater(model, capture, capture, loss, settings).update(batch, _no_timer)
    (inputs,) = loss.seen
    assert torch.equal(inputs.sampling_logprobs, torch.tensor([c.logprobs for c in group]))  # per token, as sampled
    # the sampling logprobs the weights divide by: the old weights' for the stale tokens, the new weights' over
    # the old KV for the rest (what sampled them), each token its own
    for c, sampled in zip(group, inputs.sampling_logprobs):
        then = _fresh_logprobs(model, a, prompt, c.token_ids)[:4]
        torch.testing.assert_close(sampled[:4], torch.tensor(then), atol=2e-5, rtol=0)
        torch.testing.assert_close(sampled[4:], torch.tensor(_mixed_kv_logprobs(model, a, b, prompt, c.token_ids, 4)),
                                   atol=2e-5, rtol=0)
    now = torch.tensor([_fresh_logprobs(model, b, prompt, c.token_ids) for c in group])
    weights = (now - inputs.sampling_logprobs).exp()
    assert (weights[:, :4] - 1).abs().max() > 0.05  # stale tokens really are reweighted
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(weights.mean()), rel=1e-4)


def _run(tmp_path, name: str, *, async_rollouts: bool, staleness: int, steps: int = 3):
    cfg = toy_config(tmp_path / name, steps=steps)
    cfg.train.async_rollouts, cfg.train.max_staleness = async_rollouts, staleness
    comp = toy_components(cfg)
    return train(cfg, comp, echo=lambda *a, **k: None), comp


def test_staleness_zero_equals_the_synchronous_run_exactly(tmp_path):
    sync, sync_comp = _run(tmp_path, "sync", async_rollouts=False, staleness=0)
    streamed, streamed_comp = _run(tmp_path, "async", async_rollouts=True, staleness=0)
    timing = ("time/", "step_time", "train_time")
    for a, b in zip(sync.history, streamed.history, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith((*timing, "async/", "staleness/"))}
        assert b["staleness/max"] == 0.0 and b["async/in_flight"] == 0.0
    for p, q in zip(sync_comp.policy.parameters(), streamed_comp.policy.parameters(), strict=True):
        assert torch.equal(p, q)


def test_staleness_one_trains_on_groups_one_version_old_and_no_older(tmp_path, monkeypatch):
    batches = []
    measure = cohort.trainer.token_staleness
    monkeypatch.setattr(cohort.trainer, "token_staleness", lambda batch, v: batches.append(batch) or measure(batch, v))
    result, _ = _run(tmp_path, "k1", async_rollouts=True, staleness=1, steps=4)
    for batch in batches:  # the rollout batch carries every token's version
        assert [len(v) for v in batch.token_versions] == [len(c) for c in batch.completion_ids]
    maxima = [m["staleness/max"] for m in result.history]
    assert max(maxima) == 1.0 and all(0.0 <= m["staleness/mean"] <= m["staleness/max"] for m in result.history)
    assert result.history[-1]["async/in_flight"] == 0.0  # nothing admitted past what the last step trains


def test_steps_take_groups_in_finishing_order_whole_groups_and_wait_at_the_staleness_bound():
    """P = 2 prompts a step, G = 2, k = 1; completion lengths (caps, EOS ignored) per chunk of 2 prompts."""
    model = tiny_model("llama")
    lengths = {0: [8, 2], 1: [3, 12], 2: [1, 1]}  # chunk -> per-prompt length
    seen = []

    def score(step, done, take):
        batch = take(2)
        groups = done.generate(batch.prompt_ids, SamplingParams(n=2))
        seen.append((step, [batch.indices, [[len(c.token_ids) for c in g] for g in groups]], groups))
        return types.SimpleNamespace(metrics={})

    chunks = iter([0, 1, 2])

    def draw(count):
        c = next(chunks)
        prompts = random_prompts([5, 6], seed=c)
        return types.SimpleNamespace(prompts=["", ""], prompt_ids=prompts, columns={}, indices=[10 * c, 10 * c + 1])

    rollouts = StreamingRollouts(
        _engine(model), draw, lambda step: SamplingParams(n=2, max_tokens=16, ignore_eos=True, seed=step),
        score, sampler=None, prompts_per_step=2, max_staleness=1, start_step=0, max_steps=3,
        caps=lambda chunk, row: [lengths[chunk][row]] * 2)
    metrics = [rollouts.get(step).metrics for step in (1, 2, 3)]
    # step 1: the first two groups to finish (lengths 2 and 3), laid out in admission order
    # step 2: the two groups admitted before step 1 are at their bound (one version old): the step waits for
    #         them although the two admitted at step 2 (length 1) finished first
    # step 3: those two
    assert [s[1] for s in seen] == [[[1, 10], [[2, 2], [3, 3]]], [[0, 11], [[8, 8], [12, 12]]],
                                    [[20, 21], [[1, 1], [1, 1]]]]
    assert [m["async/paced"] for m in metrics] == [0.0, 1.0, 0.0]
    assert [m["async/admitted"] for m in metrics] == [4.0, 2.0, 0.0]
    step2 = seen[1][2]
    # the long groups straddle the update: their first tokens are version 0, the rest version 1
    assert all(set(c.token_versions) == {0, 1} and c.version == 0 for g in step2 for c in g)
    assert all(set(c.token_versions) == {1} for g in seen[2][2] for c in g)
    assert all(c.token_versions == [0] * len(c.token_ids) for g in seen[0][2] for c in g)
    rollouts.close()


def test_an_engine_that_cannot_keep_sequences_is_refused_at_set_up(tmp_path):
    cfg = toy_config(tmp_path, steps=1)
    cfg.train.async_rollouts, cfg.generation.engine = True, "hf"
    with pytest.raises(ConfigError, match=r"train\.async_rollouts=true is not valid: the HFGenerateEngine"):
        toy_components(cfg)


def _two_rank_worker(rank: int, world: int, out: str, init_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    enter_rank()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cfg = toy_config(Path(out), steps=3)
        cfg.train.async_rollouts, cfg.train.max_staleness, cfg.train.device = True, 1, "cpu"
        comp = toy_components(cfg)
        train(cfg, comp, echo=lambda *a, **k: None)
        torch.save({n: p.detach() for n, p in comp.policy.named_parameters()}, f"{out}/weights-{rank}.pt")
    finally:
        dist.destroy_process_group()
    leave_rank()


def test_two_ranks_stream_their_own_slices_in_lockstep(tmp_path):
    """Each rank streams its own prompts; the per-step collectives (rewards, gradients, metrics) still meet."""
    mp.spawn(_two_rank_worker, args=(2, str(tmp_path), str(tmp_path / "init")), nprocs=2, join=True)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "staleness/max" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and max(r["staleness/max"] for r in steps) == 1.0
    w0, w1 = torch.load(tmp_path / "weights-0.pt"), torch.load(tmp_path / "weights-1.pt")
    assert all(torch.equal(w0[n], w1[n]) for n in w0)

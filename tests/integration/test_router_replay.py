"""Router replay (train.router_replay, issue 38) on the tiny float32 Qwen3-MoE (two sparse layers, top-2 of 8):

(a) the engine records, for every token it feeds, the experts the HF model's router picks for the same tokens
    teacher-forced (prefill, one-step and multi-step decode, a group's shared prompt, preemption, multi-turn);
(b) replaying the training model's own choices changes nothing: logprobs and gradients equal the plain forward's
    bit for bit (plain and shared-prompt rows, and the whole update fed by the engine's records);
(c) replaying other choices sends each token to them, with the router's softmax at those experts as weights, and
    changes the output; activation checkpointing recomputes with the replayed choices;
(d) the settings that cannot carry it are refused, naming train.router_replay;
(e) through build_components + train, the update replays each micro-batch's records and the router trains.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, toy_rows
from tests.integration.engine_models import EOS, random_prompts, tiny_model
from tests.integration.test_gspo_qwen3_moe import tiny_moe
from tests.integration.test_router_aux_loss import _Capture, _Timer
from tests.integration.test_trainer_learns import toy_config

from cohort.algorithms import build_policy_loss
from cohort.config import CohortConfig, apply_overrides
from cohort.data import load_prompt_dataset
from cohort.engine import CohortEngine
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.errors import ConfigError
from cohort.forward.packing import pack_row, packed_forward_logprobs
from cohort.forward.router_replay import RouterReplayer, replaying, routers
from cohort.rewards import RewardRunner
from cohort.rollout import RolloutBatch
from cohort.setup import build_components
from cohort.setup.settings import check_engine_abilities, replay_routes, update_settings
from cohort.trainer import train
from cohort.types import SamplingParams, TurnEnd
from cohort.update import PolicyUpdater, UpdateSettings

SPARSE, TOP_K, EXPERTS = 2, 2, 8


def _moe():
    return tiny_model("qwen3_moe").float()


def own_routes(model, prompt, completion) -> np.ndarray:
    """[P + C, sparse layers, k]: the experts the HF model's routers pick for the tokens, teacher-forced."""
    picked: list[torch.Tensor] = []
    hooks = [gate.register_forward_hook(lambda module, args, out: picked.append(out[2])) for gate in routers(model)]
    try:
        with torch.no_grad():
            model(torch.tensor([list(prompt) + list(completion)]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(picked, dim=1).numpy().astype(np.uint8)


def _engine(model, **kwargs):
    return CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=128, max_num_seqs=8,
                        record_routes=True, **kwargs)


def _assert_engine_matches_hf(model, prompts, groups):
    for prompt, group in zip(prompts, groups):
        for completion in group:
            record = completion.routed_experts
            tokens = len(prompt) + len(completion.token_ids)
            assert record is not None and record.dtype == np.uint8
            assert record.shape == (tokens - 1, SPARSE, TOP_K)  # every token but the last was fed
            np.testing.assert_array_equal(record, own_routes(model, prompt, completion.token_ids)[: tokens - 1])


# ---- (a) the engine's records ----------------------------------------------------------------------------------
@pytest.mark.parametrize("decode_steps", [1, 4])
def test_engine_records_the_routers_choices(decode_steps):
    model = _moe()
    engine = _engine(model, decode_steps=decode_steps)
    assert engine.records_routes
    prompts = random_prompts([5, 9, 3])
    groups = engine.generate(prompts, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=0))
    _assert_engine_matches_hf(model, prompts, groups)
    assert not engine.runner.routes.logs  # handed over with the completions


def test_engine_records_through_preemption_and_turns():
    model = _moe()
    engine = _engine(model, num_kv_blocks=10)  # too few blocks for every sequence: some are preempted
    prompts = random_prompts([6, 10, 7])
    groups = engine.generate(prompts, SamplingParams(n=3, max_tokens=14, temperature=1.0, seed=3, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    _assert_engine_matches_hf(model, prompts, groups)

    def on_turn_end(turn: TurnEnd):  # two tool-result tokens after each of the first two turns
        return [7, 8] if turn.turn <= 2 else None

    engine = _engine(model)
    params = SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=1, stop_token_ids=[5, 6, 9])
    groups = engine.generate_turns(prompts, params, on_turn_end)
    assert any(c.turns > 1 for group in groups for c in group)
    _assert_engine_matches_hf(model, prompts, groups)


def test_recording_off_records_nothing():
    model = _moe()
    engine = CohortEngine(model, eos_token_ids=[EOS], block_size=4, max_model_len=128)
    out = engine.generate(random_prompts([5]), SamplingParams(n=2, max_tokens=6, seed=0))
    assert not engine.records_routes and out[0][0].routed_experts is None
    assert engine.runner.net.route_out is None and not hasattr(engine.runner.routes, "decode_rows")
    with pytest.raises(ValueError, match="no routed-experts layers"):
        CohortEngine(tiny_model("llama"), record_routes=True)


# ---- (b) replaying the model's own choices changes nothing --------------------------------------------------------
def _sequences(shared: bool):
    prompts = random_prompts([5, 7, 4])
    if shared:
        prompts[1] = prompts[0]
    gen = torch.Generator().manual_seed(0)
    return [(p, torch.randint(3, 96, (n,), generator=gen).tolist()) for p, n in zip(prompts, [6, 3, 9])]


def _logprobs_and_grads(model, seqs, routes, share_prompts=False):
    model.zero_grad(set_to_none=True)
    row = pack_row(model, seqs, share_prompts=share_prompts, routes=routes)
    with replaying(model, None if row is None else row.replay):
        packed = packed_forward_logprobs(model, seqs, share_prompts=share_prompts, row=row)
        weights = torch.linspace(-1.0, 1.0, packed.logprobs.numel())
        (packed.logprobs * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return packed.logprobs.detach(), grads


@pytest.mark.parametrize("share_prompts", [False, True])
def test_replaying_own_choices_is_exact(share_prompts):
    model = _moe().train()
    seqs = _sequences(shared=share_prompts)
    # the records the engine would hand over: every position but the last
    routes = [own_routes(model, p, c)[: len(p) + len(c) - 1] for p, c in seqs]
    plain_lp, plain_grads = _logprobs_and_grads(model, seqs, None, share_prompts)
    lp, grads = _logprobs_and_grads(model, seqs, routes, share_prompts)
    assert torch.equal(lp, plain_lp)
    assert grads.keys() == plain_grads.keys() and any(n.endswith("mlp.gate.weight") for n in grads)
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


# ---- (c) replaying other choices uses them ----------------------------------------------------------------------
def _other_routes(model, seqs):
    """Each recorded position sent to the next experts over (e -> e + 1 mod 8): a different, valid choice."""
    return [((own_routes(model, p, c)[: len(p) + len(c) - 1].astype(np.int64) + 1) % EXPERTS).astype(np.uint8)
            for p, c in seqs]


def test_replayed_choices_are_the_experts_used():
    model = _moe()
    seqs = _sequences(shared=False)
    routes = _other_routes(model, seqs)
    seen: list[tuple] = []
    blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    hooks = [b.experts.register_forward_pre_hook(lambda module, args: seen.append(args)) for b in blocks]
    hooks += [b.gate.register_forward_hook(lambda module, args, out: seen.append(out)) for b in blocks]
    try:
        replayed, _ = _logprobs_and_grads(model, seqs, routes)
    finally:
        for hook in hooks:
            hook.remove()
    plain, _ = _logprobs_and_grads(model, seqs, None)
    assert (replayed - plain).abs().max() > 1e-3  # other experts, another output
    ends = np.cumsum([len(p) + len(c) for p, c in seqs]) - 1  # each sequence's last token: no record
    expected = np.concatenate([r for r in routes], axis=0)
    rows = np.setdiff1d(np.arange(ends[-1] + 1), ends)
    for layer in range(SPARSE):
        (logits, _, _), (_, experts, weights) = seen[2 * layer], seen[2 * layer + 1]
        np.testing.assert_array_equal(experts[rows].numpy(), expected[:, layer])
        probs = logits.float().softmax(-1).gather(-1, experts)
        torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))  # norm_topk_prob
        own = logits.float().softmax(-1).topk(TOP_K).indices
        assert torch.equal(experts[ends], own[ends])  # no record: the router's own top-k


def test_checkpointed_backward_recomputes_with_the_replayed_choices():
    seqs = _sequences(shared=False)
    model = _moe().train()
    routes = _other_routes(model, seqs)
    _, plain = _logprobs_and_grads(model, seqs, routes)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, checkpointed = _logprobs_and_grads(model, seqs, routes)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7)


# ---- the update, fed by the engine ----------------------------------------------------------------------------


def _rollout(model):
    prompts = random_prompts([5, 8])
    groups = _engine(model).generate(prompts, SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=4))
    completions = [c for group in groups for c in group]
    n = len(completions)
    return RolloutBatch(
        prompt_ids=[p for p in prompts for _ in range(2)], completion_ids=[c.token_ids for c in completions],
        sampling_logprobs=[c.logprobs for c in completions], finish_reasons=[c.finish_reason for c in completions],
        completions_text=[""] * n, prompts=[""] * n, rewards_per_func=torch.zeros(n, 1), rewards=torch.zeros(n),
        advantages=torch.tensor([0.9, -0.4, 0.6, -0.8]), loss_mask_keep=[True] * n, group_size=2,
        routed_experts=[c.routed_experts for c in completions])


def _update_grads(batch, router_replay: bool, num_iterations: int = 2):
    model = _moe().train()
    capture = _Capture(list(model.parameters()))
    settings = UpdateSettings(mini_batches=1, num_iterations=num_iterations, token_budget=20, temperature=1.0,
                              max_grad_norm=1e9, max_completion_length=10, share_prompts=True,
                              router_replay=router_replay)
    used: list = []
    updater = PolicyUpdater(model, capture, capture, build_policy_loss("grpo", {}), settings)
    if updater.replayer is not None:
        use = updater.replayer.use
        updater.replayer.use = lambda replay: (used.append(replay), use(replay))[1]
    updater.update(batch, _Timer())
    return capture.grads, used


def test_update_replays_the_engines_records():
    """The engine's float32 records are the training router's own choices: the update's gradient is unchanged,
    every micro-batch (old logprobs and the update's passes) replayed one; shifted records change the gradient."""
    batch = _rollout(_moe())
    plain, _ = _update_grads(batch, router_replay=False)
    replayed, used = _update_grads(batch, router_replay=True)
    assert sum(r is not None for r in used) >= 3  # old logprobs and two passes of the update, each micro-batch
    for a, b in zip(plain, replayed):
        assert torch.equal(a, b)
    batch.routed_experts = [((r.astype(np.int64) + 1) % EXPERTS).astype(np.uint8) for r in batch.routed_experts]
    shifted, _ = _update_grads(batch, router_replay=True)
    assert any(not torch.equal(a, b) for a, b in zip(plain, shifted))
    batch.routed_experts = None
    with pytest.raises(ValueError, match="no recorded routing"):
        _update_grads(batch, router_replay=True)


def test_training_steps_replay_the_rollouts_routing(tmp_path, monkeypatch):
    """train.router_replay through build_components + train: the engine records, every micro-batch of the update
    replays a record laid out for its row, and the router and experts train."""
    cfg = apply_overrides(toy_config(tmp_path, steps=1), [
        "train.router_replay=true", "train.num_iterations=2", "train.prompts_per_step=2",
        "generation.num_generations=4", "generation.engine=cohort"]).validate()
    tok = make_tiny_tokenizer()
    comp = build_components(cfg, policy=tiny_moe(tok), tokenizer=tok, reward_runner=RewardRunner([digit_share]),
                            train_data=load_prompt_dataset(toy_rows()).encode(tok, 64))
    assert comp.engine.records_routes and comp.update_settings.router_replay
    rows: list[int] = []
    use = RouterReplayer.use
    monkeypatch.setattr(RouterReplayer, "use", lambda self, replay: (
        rows.append(-1 if replay is None else replay.experts.shape[0]), use(self, replay))[1])
    gate = comp.policy.model.layers[0].mlp.gate.weight.detach().clone()
    result = train(cfg, comp)
    assert math.isfinite(result.history[0]["grad_norm"]) and result.history[0]["grad_norm"] > 0
    assert sum(n > 0 for n in rows) >= 2  # old logprobs and the update's forwards, each on its row's record
    assert not torch.equal(comp.policy.model.layers[0].mlp.gate.weight, gate)


def test_replayer_leaves_the_routers_as_they_were():
    model = _moe()
    replayer = RouterReplayer(model)
    with replayer.active():
        assert all("forward" in gate.__dict__ for gate in routers(model))
    assert all("forward" not in gate.__dict__ for gate in routers(model))


# ---- (d) what cannot carry it is refused ------------------------------------------------------------------------
def test_router_replay_refusals():
    assert CohortConfig().train.router_replay is False
    for overrides, words in ((["generation.placement=server", "generation.server_address=127.0.0.1:8000"],
                              "generation.placement=server"),
                             (["generation.engine=hf"], "generation.engine=hf")):
        with pytest.raises(ConfigError, match=re.escape(f"train.router_replay=True is not valid: {words}")):
            apply_overrides(CohortConfig(), ["train.router_replay=true", *overrides]).validate()
    cfg = apply_overrides(CohortConfig(), ["train.router_replay=true"]).validate()
    assert replay_routes(cfg, _moe()) and update_settings(cfg, _moe()).router_replay
    assert not replay_routes(CohortConfig(), tiny_model("llama"))
    with pytest.raises(ConfigError, match=r"train\.router_replay=true is not valid: LlamaForCausalLM has no mixture"):
        replay_routes(cfg, tiny_model("llama"))
    with pytest.raises(ConfigError, match=r"train\.router_replay=true is not valid: the HFGenerateEngine engine"):
        check_engine_abilities(cfg, HFGenerateEngine(_moe(), SimpleNamespace(pad_token_id=0, eos_token_id=EOS)))
    check_engine_abilities(cfg, _engine(_moe()))  # cohort's recording engine: accepted

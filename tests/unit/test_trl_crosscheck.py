"""Every TRL loss type against TRL 1.16.0's own GRPOTrainer._compute_loss, and against an exact re-derivation.

How the TRL check works: `GRPOTrainer._compute_loss` is called *unbound* with a SimpleNamespace standing in
for `self`: it holds exactly the attributes the method reads (loss_type, epsilon_low/high, beta, args.*, a
single-process accelerator stub, ...) and a stub `_get_per_token_logps_and_entropies` that returns our
random float64 log-probs and entropies instead of running a model. The inputs are the whole batch in one
micro-batch (gradient_accumulation_steps = 1, steps_per_generation = 1, one process), the case where TRL's
per-micro-batch normalisation and our global one coincide. Loss, gradient w.r.t. the log-probs (and the
entropies, for the entropy bonus) and the logged metrics must agree within 1e-6.

The TRL part is skipped when trl is not installed; `reference_loss` below, re-derived by hand from TRL's
source one sequence at a time, is always checked against our implementation on the same cases.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from cohort.algorithms import LossInputs, get_policy_loss

B, T, MAX_LEN = 6, 7, 9
TOL = 1e-6

# (loss_type, overrides). Overrides use cohort's parameter names; `_trl_args` maps them to TRL's.
BASE = [(name, {}) for name in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo")]
EXTRA = [
    ("dapo", {"epsilon_high": 0.28, "beta": 0.04}),
    ("dapo", {"beta": 0.04, "use_bias_correction_kl": False}),
    ("grpo", {"importance_sampling_level": "sequence", "beta": 0.02}),
    ("luspo", {"importance_sampling_level": "sequence"}),
    ("grpo", {"delta": 1.3, "epsilon_high": 0.25}),
    ("bnpo", {"top_entropy_quantile": 0.4, "entropy_coef": 0.01}),
    ("dr_grpo", {"entropy_coef": 0.05, "beta": 0.1}),
    ("cispo", {"epsilon_high": 1.2, "beta": 0.04}),
    ("cispo", {"importance_sampling_level": "sequence", "epsilon_high": 1.05}),
    ("sapo", {"sapo_temperature_pos": 0.8, "sapo_temperature_neg": 1.3, "beta": 0.04}),
    ("vespo", {"vespo_k_pos": 1.5, "vespo_lambda_neg": 2.5}),
    ("dapo", {"off_policy_mask_threshold": 0.02}),
    ("grpo", {"off_policy_mask_threshold": 0.02, "sampling": True}),
] + [
    (loss, {"sampling": True, "sampler_is_mode": mode, "sampler_is_clip_min": lo, "sampler_is_clip_max": hi})
    for loss in ("dapo", "grpo", "cispo", "sapo", "dr_grpo", "luspo", "bnpo")
    for mode, lo, hi in (("token_truncate", 0.8, 1.1), ("token_mask", 0.9, 1.1),
                         ("sequence_truncate", None, 1.2), ("sequence_mask", 0.7, 1.3))
] + [
    ("vespo", {"sampling": True, "sampler_is_mode": mode, "sampler_is_clip_min": 0.9, "sampler_is_clip_max": 1.1})
    for mode in ("token_truncate", "token_mask")
]
CASES = BASE + EXTRA
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]


def make_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(dt)
    logps = -torch.rand(B, T, generator=g, dtype=dt) * 3 - 0.05
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=dt)  # off-policy: ratios spread around 1
    return SimpleNamespace(
        mask=mask,
        logps=logps,
        old=old,
        ref=logps + 0.2 * torch.randn(B, T, generator=g, dtype=dt),
        sampling=old + 0.15 * torch.randn(B, T, generator=g, dtype=dt),
        entropy=torch.rand(B, T, generator=g, dtype=dt) * 2,
        advantages=torch.tensor([1.2, -0.7, 0.4, -1.5, 0.0, 0.9], dtype=dt),
    )


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16 `_generate_and_score_completions`' vLLM importance ratio, re-derived (it runs at generation)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = diff.exp()
    if mode.endswith("truncate"):
        return ratio.clamp(min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def settings(loss_type: str, overrides: dict) -> SimpleNamespace:
    """TRL GRPOConfig defaults, cispo's epsilon_high aside (set explicitly, as TRL users must), plus overrides."""
    s = dict(epsilon=0.2, epsilon_high=None, delta=None, beta=0.0, importance_sampling_level="token",
             use_bias_correction_kl=True, top_entropy_quantile=1.0, entropy_coef=0.0, off_policy_mask_threshold=None,
             sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
             vespo_k_neg=3.0, vespo_lambda_neg=2.0, sampling=False, sampler_is_mode="sequence_mask",
             sampler_is_clip_min=None, sampler_is_clip_max=3.0)
    if loss_type == "cispo":
        s["epsilon_high"] = 5.0
    if loss_type == "vespo":
        s["sampler_is_mode"] = "token_truncate"
    s.update(overrides)
    return SimpleNamespace(loss_type=loss_type, **s)


def ours(cfg: SimpleNamespace, batch) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
    params = {k: getattr(cfg, k) for k in ("beta", "importance_sampling_level", "use_bias_correction_kl",
                                           "top_entropy_quantile", "entropy_coef", "off_policy_mask_threshold",
                                           "sampler_is_mode", "sampler_is_clip_min", "sampler_is_clip_max")}
    if cfg.loss_type in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo"):
        params.update(epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high, delta=cfg.delta)
    elif cfg.loss_type == "cispo":
        params.update(epsilon_high=cfg.epsilon_high)
    elif cfg.loss_type == "sapo":
        params.update(sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg)
    else:
        params.update({k: getattr(cfg, k) for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})
    loss_fn = get_policy_loss(cfg.loss_type, **params)
    logps = batch.logps.clone().requires_grad_(True)
    entropy = batch.entropy.clone().requires_grad_(True)
    out = loss_fn(LossInputs(
        logprobs=logps, mask=batch.mask, advantages=batch.advantages, old_logprobs=batch.old,
        ref_logprobs=batch.ref, sampling_logprobs=batch.sampling if cfg.sampling else None, entropy=entropy,
        max_completion_length=MAX_LEN))
    out.loss.backward()
    return out.loss.detach(), {k: v.item() for k, v in out.metrics.items()}, logps.grad, entropy.grad


# ----------------------------------------------------------------------------------------------------------
# Exact re-derivation of TRL 1.16 `_compute_loss` for one micro-batch, one sequence at a time.
# ----------------------------------------------------------------------------------------------------------
def _seq_weight(cfg, lp, old, m):
    log_ratio = lp - old
    if cfg.importance_sampling_level == "sequence":
        return torch.exp((log_ratio * m).sum() / m.sum().clamp(min=1.0)).expand_as(lp)
    return torch.exp(log_ratio)


def _vespo_phi(cfg, lp, old, m, a, is_row):
    with torch.no_grad():
        s = (torch.clamp(lp - old, -20, 20) * m).sum()
        if is_row is not None:
            s = s + torch.clamp(torch.log(is_row), math.log(1e-8), 20).sum()
        lw = torch.clamp(s, math.log(1e-8), 20)
        k, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if a >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
        phi = math.exp(lam + k * lw.item() - lam * math.exp(lw.item()))
    return 0.0 if not math.isfinite(phi) else phi


def _row_objective(cfg, lp, old, m, a, r, is_row):
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    if cfg.loss_type == "cispo":
        return -torch.clamp(r, max=eps_high).detach() * a * lp
    if cfg.loss_type == "sapo":
        tau = cfg.sapo_temperature_pos if a > 0 else cfg.sapo_temperature_neg
        return -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
    if cfg.loss_type == "vespo":
        return -_vespo_phi(cfg, lp, old, m, a, is_row) * a * lp
    unclipped = r if cfg.delta is None else torch.clamp(r, max=cfg.delta)
    return -torch.min(unclipped * a, torch.clamp(r, 1 - cfg.epsilon, 1 + eps_high) * a)


def reference_loss(cfg, lp_all, b, is_ratio, ent_all):
    """Sum over rows of TRL's per-row contribution, with TRL's normalisers for a single micro-batch."""
    threshold = None
    if cfg.top_entropy_quantile < 1.0:
        threshold = torch.quantile(ent_all.detach()[b.mask.bool()].float(), 1 - cfg.top_entropy_quantile)
    total_tokens = b.mask.sum()
    loss = lp_all.new_zeros(())
    ent_num, ent_den = lp_all.new_zeros(()), lp_all.new_zeros(())
    for i in range(B):
        lp, old, m, a = lp_all[i], b.old[i], b.mask[i], b.advantages[i].item()
        is_row = None if is_ratio is None else is_ratio[i].expand_as(lp)
        r = _seq_weight(cfg, lp, old, m)
        row = _row_objective(cfg, lp, old, m, a, r, is_row)
        if cfg.off_policy_mask_threshold is not None:
            behaviour = b.sampling[i] if cfg.sampling else old
            mean_kl = ((behaviour - lp.detach()) * m).sum() / m.sum().clamp(min=1.0)
            if a < 0 and mean_kl > cfg.off_policy_mask_threshold:
                row = row * 0.0
        keep = m if threshold is None else m * ((ent_all[i].detach() * m >= threshold).to(m.dtype))
        row = row * keep if threshold is not None else row
        if is_row is not None and cfg.loss_type != "vespo":
            row = row * is_row
        if cfg.beta != 0.0:
            d = b.ref[i] - lp
            kl = torch.exp(d) - d - 1
            row = row + cfg.beta * (kl * r if cfg.use_bias_correction_kl else kl)
        if cfg.loss_type in ("grpo", "sapo"):
            loss = loss + (row * m).sum() / m.sum().clamp(min=1.0) / B
        elif cfg.loss_type == "dr_grpo":
            loss = loss + (row * m).sum() / (B * MAX_LEN)
        elif cfg.loss_type == "luspo":
            loss = loss + (row * m).sum() / B
        else:  # bnpo (one micro-batch), dapo, cispo, vespo: the batch's loss tokens
            loss = loss + (row * m).sum() / total_tokens
        ent_num = ent_num + (ent_all[i] * keep).sum()
        ent_den = ent_den + keep.sum()
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * ent_num / ent_den.clamp(min=1.0)
    return loss


@pytest.mark.parametrize(("loss_type", "overrides"), CASES, ids=IDS)
def test_matches_exact_rederivation(loss_type, overrides):
    cfg = settings(loss_type, overrides)
    b = make_batch(seed=len(IDS) + CASES.index((loss_type, overrides)))
    loss, _, grad, ent_grad = ours(cfg, b)
    lp = b.logps.clone().requires_grad_(True)
    ent = b.entropy.clone().requires_grad_(True)
    is_ratio = None
    if cfg.sampling:
        is_ratio = trl_is_ratio(b.old, b.sampling, b.mask, cfg.sampler_is_mode, cfg.sampler_is_clip_min,
                                cfg.sampler_is_clip_max)
    ref = reference_loss(cfg, lp, b, is_ratio, ent)
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=TOL, rel=TOL)
    torch.testing.assert_close(grad, lp.grad, atol=TOL, rtol=TOL)
    if cfg.entropy_coef:
        torch.testing.assert_close(ent_grad, ent.grad, atol=TOL, rtol=TOL)


# ----------------------------------------------------------------------------------------------------------
# The real thing: TRL's GRPOTrainer._compute_loss with a stand-in `self`.
# ----------------------------------------------------------------------------------------------------------
class _Accelerator:
    """A single process: gather/reduce are identities."""

    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def pad_across_processes(x, dim=0, pad_index=0):
        return x


def trl_stand_in(trainer_cls, cfg, logps, entropy):
    args = SimpleNamespace(
        delta=cfg.delta, use_bias_correction_kl=cfg.use_bias_correction_kl, steps_per_generation=1,
        sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
        vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
        vespo_lambda_neg=cfg.vespo_lambda_neg, entropy_target=0.0,
    )
    me = SimpleNamespace(
        args=args, loss_type=cfg.loss_type, beta=cfg.beta, epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high,
        importance_sampling_level=cfg.importance_sampling_level, top_entropy_quantile=cfg.top_entropy_quantile,
        off_policy_mask_threshold=cfg.off_policy_mask_threshold, use_vllm=cfg.sampling,
        vllm_importance_sampling_correction=cfg.sampling, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, accelerator=_Accelerator(),
        entropy_coef=cfg.entropy_coef, use_adaptive_entropy=False, _entropy_bonus_enabled=cfg.entropy_coef != 0.0,
        aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        get_off_policy_mask=trainer_cls.get_off_policy_mask, get_gamma_weights=trainer_cls.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, entropy, None),
    )
    me.get_high_entropy_mask = functools.partial(trainer_cls.get_high_entropy_mask, me)
    return me


@pytest.mark.parametrize(("loss_type", "overrides"), CASES, ids=IDS)
def test_matches_trl_compute_loss(loss_type, overrides):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="needs TRL: pip install trl==1.16.0")
    cfg = settings(loss_type, overrides)
    b = make_batch(seed=CASES.index((loss_type, overrides)))
    loss, metrics, grad, ent_grad = ours(cfg, b)

    lp = b.logps.clone().requires_grad_(True)
    ent = b.entropy.clone().requires_grad_(True)
    me = trl_stand_in(trl_grpo.GRPOTrainer, cfg, lp, ent)
    inputs = {
        "prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b.mask,
        "advantages": b.advantages, "old_per_token_logps": b.old, "ref_per_token_logps": b.ref,
        "num_items_in_batch": b.mask.sum(),
    }
    if cfg.sampling:
        inputs["sampling_per_token_logps"] = b.sampling
        inputs["importance_sampling_ratio"] = trl_is_ratio(b.old, b.sampling, b.mask, cfg.sampler_is_mode,
                                                           cfg.sampler_is_clip_min, cfg.sampler_is_clip_max)
    trl_loss = trl_grpo.GRPOTrainer._compute_loss(me, None, inputs)
    trl_loss.backward()

    assert loss.item() == pytest.approx(trl_loss.item(), abs=TOL, rel=TOL)
    torch.testing.assert_close(grad, lp.grad, atol=TOL, rtol=TOL)
    if cfg.entropy_coef:
        torch.testing.assert_close(ent_grad, ent.grad, atol=TOL, rtol=TOL)
    logged = {k: v[0] for k, v in me._metrics["train"].items() if k not in ("policy_loss", "entropy_coef")}
    assert logged, "TRL logged nothing: the stand-in no longer exercises the metric code"
    for name, value in logged.items():
        assert metrics[name] == pytest.approx(value, abs=TOL, rel=TOL, nan_ok=True), name

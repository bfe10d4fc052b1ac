"""Every policy-loss variant on tiny inputs whose loss and gradient are derived by hand in the comments.

Convention: old log-probs are 0 unless said otherwise, so a token with ``logp = ln r`` has ratio ``r``;
gradients are d loss / d logp.
"""

import math
import sys
import textwrap

import pytest
import torch

from cohort.algorithms import (
    LossInputs,
    build_policy_loss,
    get_policy_loss,
    list_policy_losses,
    policy_loss_parameters,
    reduce_metrics,
)

D = torch.float64


def run(loss, logp, adv, mask=None, old=None, **extra):
    logp = torch.tensor(logp, dtype=D).requires_grad_(True)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask, dtype=D)
    old = torch.zeros_like(logp) if old == "zeros" else (None if old is None else torch.tensor(old, dtype=D))
    out = loss(LossInputs(logprobs=logp, mask=mask, advantages=torch.tensor(adv, dtype=D), old_logprobs=old, **extra))
    out.loss.backward()
    return out.loss.item(), logp.grad, {k: v.item() for k, v in out.metrics.items()}


def assert_grad(grad, expected):
    torch.testing.assert_close(grad, torch.tensor(expected, dtype=D), atol=1e-12, rtol=1e-9)


def test_dapo_clipping_and_metrics():
    # ratios 1.5, 0.5, 1.1 (one token each), A = 1, -1, 2, eps 0.2 / eps_high 0.28:
    #  row 0: -min(1.5*1, 1.28*1) = -1.28 (high-clipped: grad 0)
    #  row 1: -min(0.5*-1, 0.8*-1) = 0.8   (low-clipped: grad 0)
    #  row 2: -min(2.2, 2.2) = -2.2, grad -A r = -2.2
    # token-mean: (-1.28 + 0.8 - 2.2) / 3 = -0.8933333; grad row 2 = -2.2 / 3
    loss_fn = get_policy_loss("dapo", epsilon_high=0.28)
    loss, grad, m = run(loss_fn, [[math.log(1.5)], [math.log(0.5)], [math.log(1.1)]], [1.0, -1.0, 2.0], old="zeros")
    assert loss == pytest.approx(-2.68 / 3)
    assert_grad(grad, [[0.0], [0.0], [-2.2 / 3]])
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    assert m["clip_ratio/low_min"] == 0.0 and m["clip_ratio/high_max"] == 1.0


def test_two_sided_delta_clip():
    # r = 1.5, A = -1. Plain: -min(-1.5, -1.2) = 1.5, grad -A r = 1.5.
    # delta = 1.3 caps the unclipped ratio: -min(-1.3, -1.2) = 1.3 and the capped branch has grad 0.
    logp, adv = [[math.log(1.5)]], [-1.0]
    loss, grad, _ = run(get_policy_loss("dapo"), logp, adv, old="zeros")
    assert loss == pytest.approx(1.5) and grad.item() == pytest.approx(1.5)
    loss, grad, _ = run(get_policy_loss("dapo", delta=1.3), logp, adv, old="zeros")
    assert loss == pytest.approx(1.3) and grad.item() == 0.0


def test_dual_clip():
    # clip_ratio_c = 3, A = -1: r = 5 -> standard loss 5 is capped at -A c = 3 (grad 0); r = 2 -> 2 stays,
    # grad -A r = 2. token-mean over 2: loss (3 + 2)/2 = 2.5, grads (0, 1)
    loss, grad, m = run(get_policy_loss("dapo", clip_ratio_c=3.0), [[math.log(5.0)], [math.log(2.0)]], [-1.0, -1.0],
                        old="zeros")
    assert loss == pytest.approx(2.5)
    assert_grad(grad, [[0.0], [1.0]])
    assert m["clip_ratio/dual_mean"] == pytest.approx(0.5)


# On-policy (ratio 1), rows of 3 and 1 loss tokens, A = 1 and -2, so L = -A per token:
# row sums -3 and +2; 4 tokens; 2 rows.
AGG_LOGP = [[-0.5, -1.0, -0.2], [-0.3, -9.0, -9.0]]
AGG_MASK = [[1, 1, 1], [1, 0, 0]]


@pytest.mark.parametrize(("name", "loss", "g0", "g1"), [
    ("dapo", (-3 + 2) / 4, -1 / 4, 2 / 4),                        # token-mean: sum / 4 tokens
    ("bnpo", (-3 + 2) / 4, -1 / 4, 2 / 4),
    ("token-mean", (-3 + 2) / 4, -1 / 4, 2 / 4),
    ("grpo", (-3 / 3 + 2 / 1) / 2, -1 / 3 / 2, 2 / 2),            # mean of per-row token means
    ("seq-mean-token-mean", 0.5, -1 / 6, 1.0),
    ("luspo", (-3 + 2) / 2, -1 / 2, 2 / 2),                       # row sums, mean over rows
    ("seq-mean-token-sum", -0.5, -0.5, 1.0),
    ("dr_grpo", (-3 + 2) / (2 * 4), -1 / 8, 2 / 8),               # sum / (rows * max_completion_length 4)
    ("seq-mean-token-sum-norm", -0.125, -1 / 8, 2 / 8),
])
def test_aggregations(name, loss, g0, g1):
    value, grad, _ = run(get_policy_loss(name), AGG_LOGP, [1.0, -2.0], mask=AGG_MASK, max_completion_length=4)
    assert value == pytest.approx(loss)
    assert_grad(grad, [[g0, g0, g0], [g1, 0.0, 0.0]])


def test_dr_grpo_loss_scale_factor_overrides_max_length():
    value, _, _ = run(get_policy_loss("dr_grpo", loss_scale_factor=10.0), AGG_LOGP, [1.0, -2.0], mask=AGG_MASK,
                      max_completion_length=4)
    assert value == pytest.approx(-1 / 20)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        run(get_policy_loss("dr_grpo"), AGG_LOGP, [1.0, -2.0], mask=AGG_MASK)


def test_gspo_sequence_ratio_and_gradient():
    # log-ratios 0.2, -0.4 -> sequence ratio exp(mean) = exp(-0.1) = 0.9048374 (inside [0.8, 1.2]); A = 1
    # grpo: L = -0.9048374 on both tokens, token mean -0.9048374; d r / d logp_t = r / 2 -> grad -0.4524187
    r = math.exp(-0.1)
    value, grad, m = run(get_policy_loss("grpo", importance_sampling_level="sequence"), [[0.2, -0.4]], [1.0],
                         old="zeros")
    assert value == pytest.approx(-r)
    assert_grad(grad, [[-r / 2, -r / 2]])
    assert m["clip_ratio/region_mean"] == 0.0


def test_gspo_clips_whole_sequence():
    # log-ratios 0.5, 0.3 -> r = exp(0.4) = 1.4918 > 1.2 with A = 1: the whole sequence is clipped, grad 0
    value, grad, m = run(get_policy_loss("grpo", importance_sampling_level="sequence"), [[0.5, 0.3]], [1.0],
                         old="zeros")
    assert value == pytest.approx(-1.2)
    assert_grad(grad, [[0.0, 0.0]])
    assert m["clip_ratio/high_mean"] == 1.0  # one sequence of one, counted per sequence


def test_cispo_detached_clipped_weight_keeps_gradient():
    # r = 3, 6 with A = 1; eps_max = 5 (default): weights sg(min(r, 5)) = 3, 5
    # L = -w A logp: value -(3 ln 3 + 5 ln 6)/2 = -6.1273169; grad -w/2 = -1.5, -2.5 (the clipped token still
    # learns, unlike PPO's clip where it would get 0)
    value, grad, m = run(get_policy_loss("cispo"), [[math.log(3.0)], [math.log(6.0)]], [1.0, 1.0], old="zeros")
    assert value == pytest.approx(-(3 * math.log(3) + 5 * math.log(6)) / 2)
    assert_grad(grad, [[-1.5], [-2.5]])
    assert m["cispo_clip_ratio"] == pytest.approx(0.5)


def test_cispo_epsilon_high_default_and_guard():
    assert get_policy_loss("cispo").epsilon_high == 5.0
    assert build_policy_loss("cispo", {"epsilon_high": None}).epsilon_high == 5.0  # unset -> sound default
    # below 1 a cap would down-weight on-policy tokens: it is a clip range (MiniMax-M1, verl), 1 + 0.28
    with pytest.warns(UserWarning, match=r"epsilon_high=0.28 under cispo.*eps_max = 1 \+ 0.28 = 1.28"):
        assert get_policy_loss("cispo", epsilon_high=0.28).epsilon_high == pytest.approx(1.28)
    assert get_policy_loss("cispo", epsilon_high=1.2).epsilon_high == 1.2  # >= 1: the cap itself, as TRL
    with pytest.raises(ValueError, match=r"epsilon_high=-0.1 under cispo must be >= 0"):
        get_policy_loss("cispo", epsilon_high=-0.1)
    with pytest.raises(ValueError, match="'epsilon' is not known"):  # cispo has no lower clip
        get_policy_loss("cispo", epsilon=0.2)


def test_sapo_soft_gate():
    # row 0: r = 1, A = 2, tau 1: gate 4 sigmoid(0) / 1 = 2 -> L = -4; grad -A * 4 s(1-s) * r = -2 * 1 * 1 = -2
    # row 1: r = 1, A = -1, tau 1.05: gate 2 / 1.05 = 1.9047619 -> L = 1.9047619; grad -A * 1 = 1
    # row 2: r = 2, A = 1, tau 1: gate 4 sigmoid(1) = 2.9242344 -> L = -2.9242344;
    #        grad -A * 4 s(1-s) * r = -4 * 0.1966119 * 2 = -1.5728954
    s1 = 1 / (1 + math.exp(-1))
    value, grad, _ = run(get_policy_loss("sapo"), [[0.0], [0.0], [math.log(2.0)]], [2.0, -1.0, 1.0], old="zeros")
    assert value == pytest.approx((-4 + 2 / 1.05 - 4 * s1) / 3)  # grpo-style mean of 1-token rows
    assert_grad(grad, [[-2 / 3], [1 / 3], [-8 * s1 * (1 - s1) / 3]])


def test_vespo_gamma_weight():
    # log-ratios 0.1, 0.2 -> sequence log w = 0.3 (a sum), w = 1.3498588; A = 1 -> k = 2, lam = 3
    # log phi = 3 + 2 * 0.3 - 3 * 1.3498588 = -0.4495764 -> phi = 0.6379023
    # L = -sg(phi) A logp, token-mean over 2: grad -phi / 2 = -0.3189511
    phi = math.exp(3 + 0.6 - 3 * math.exp(0.3))
    value, grad, m = run(get_policy_loss("vespo"), [[0.1, 0.2]], [1.0], old="zeros")
    assert value == pytest.approx(-phi * 0.3 / 2)
    assert_grad(grad, [[-phi / 2, -phi / 2]])
    assert m["vespo/phi_seq_mean"] == pytest.approx(phi)
    # on-policy w = 1 -> phi(1) = exp(lam - lam) = 1 for either sign
    _, grad, m = run(get_policy_loss("vespo"), [[-0.7]], [-1.0])
    assert m["vespo/phi_seq_mean"] == pytest.approx(1.0) and grad.item() == pytest.approx(1.0)


def test_kl_term_with_and_without_bias_correction():
    # one token, on-policy, A = 0, d = logp - ref = ln 2: k3 = 0.5 + ln 2 - 1 = 0.1931472, beta 0.1
    # value 0.1 * k3; grad without correction: 0.1 * (1 - e^-d) = 0.05
    # with correction the term is beta * k3 * r (r = 1 with d r / d logp = 1): 0.1 * (0.5 + 0.1931472)
    k3 = 0.5 + math.log(2) - 1
    ref = torch.tensor([[0.0]], dtype=D)
    for correct, expected_grad in ((False, 0.05), (True, 0.1 * (0.5 + k3))):
        loss_fn = get_policy_loss("dapo", beta=0.1, use_bias_correction_kl=correct)
        value, grad, m = run(loss_fn, [[math.log(2)]], [0.0], ref_logprobs=ref)
        assert value == pytest.approx(0.1 * k3)
        assert grad.item() == pytest.approx(expected_grad)
        assert m["kl"] == pytest.approx(k3)


def test_straight_through_kl_estimator_in_loss():
    # k3+ keeps the k3 value and takes k2's gradient d = ln 2: grad 0.1 * ln 2
    loss_fn = get_policy_loss("dapo", beta=0.1, kl_estimator="k3+", use_bias_correction_kl=False)
    value, grad, _ = run(loss_fn, [[math.log(2)]], [0.0], ref_logprobs=torch.zeros(1, 1, dtype=D))
    assert value == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert grad.item() == pytest.approx(0.1 * math.log(2))


def test_entropy_bonus_gradient():
    # entropy (0.5, 1.5), coef 0.1: loss -= 0.1 * mean H = 0.1; d loss / d H_t = -0.1 / 2
    ent = torch.tensor([[0.5, 1.5]], dtype=D, requires_grad=True)
    value, _, m = run(get_policy_loss("dapo", entropy_coef=0.1), [[0.0, 0.0]], [0.0], entropy=ent)
    assert value == pytest.approx(-0.1)
    assert_grad(ent.grad, [[-0.05, -0.05]])
    assert m["entropy"] == pytest.approx(1.0)


def test_top_entropy_quantile():
    # entropies 0.1, 0.9, 0.5, 0.3; keep top 50%: threshold = quantile(0.5) = (0.3 + 0.5)/2 = 0.4 -> tokens 1, 2
    # on-policy A = 1: L = -1 on kept tokens; dapo normalises by all 4 loss tokens: -2/4; grads -1/4 on kept only
    ent = torch.tensor([[0.1, 0.9, 0.5, 0.3]], dtype=D)
    value, grad, _ = run(get_policy_loss("dapo", top_entropy_quantile=0.5), [[0.0] * 4], [1.0], entropy=ent)
    assert value == pytest.approx(-0.5)
    assert_grad(grad, [[0.0, -0.25, -0.25, 0.0]])


@pytest.mark.parametrize(("mode", "w", "expected"), [
    ("token_truncate", (2.0, 0.5), (1.5, 0.8)),   # clamp to [0.8, 1.5]
    ("token_mask", (2.0, 0.9), (0.0, 0.9)),       # 2.0 > 1.5 -> 0
    ("sequence_truncate", (2.0, 1.0), (1.5, 1.5)),  # sequence weight 2 * 1 = 2 -> 1.5 on every token
    ("sequence_mask", (2.0, 0.5), (1.0, 1.0)),    # 2 * 0.5 = 1, kept
    ("sequence_mask", (2.0, 1.0), (0.0, 0.0)),    # 2 > 1.5, whole sequence dropped
])
def test_sampler_importance_correction(mode, w, expected):
    # on-policy, A = 1 -> L = -w_t per token; sampling logp = logp - ln w so that exp(old - sampling) = w
    logp = [[-0.4, -1.2]]
    sampling = torch.tensor(logp, dtype=D) - torch.log(torch.tensor([w], dtype=D))
    loss_fn = get_policy_loss("dapo", sampler_is_mode=mode, sampler_is_clip_min=0.8, sampler_is_clip_max=1.5)
    value, grad, _ = run(loss_fn, logp, [1.0], sampling_logprobs=sampling)
    assert value == pytest.approx(-sum(expected) / 2)
    assert_grad(grad, [[-e / 2 for e in expected]])


def test_off_policy_sequence_mask():
    # sampling logp exceeds logp by 0.1 per token: mean KL 0.1 > threshold 0.05 -> drop if A < 0, keep if A >= 0
    loss_fn = get_policy_loss("dapo", off_policy_mask_threshold=0.05, sampler_is_correction=False)
    logp = [[-1.0, -1.0], [-1.0, -1.0]]
    sampling = torch.tensor(logp, dtype=D) + 0.1
    value, grad, _ = run(loss_fn, logp, [-1.0, 1.0], sampling_logprobs=sampling)
    assert value == pytest.approx(-2 / 4)
    assert_grad(grad, [[0.0, 0.0], [-0.25, -0.25]])


def test_every_registered_loss_builds_and_runs():
    for name in list_policy_losses():
        value, grad, m = run(get_policy_loss(name), AGG_LOGP, [1.0, -2.0], mask=AGG_MASK, max_completion_length=4)
        assert math.isfinite(value) and grad[1, 1:].abs().sum() == 0.0, name
        assert "policy_loss" in m


def test_unknown_parameter_suggests():
    with pytest.raises(ValueError, match=r"'epsilon_hi' is not known\. Did you mean 'epsilon_high'"):
        build_policy_loss("dapo", {"epsilon_hi": 0.28})
    with pytest.raises(ValueError, match=r"'dapoo' is not known\. Did you mean 'dapo'"):
        get_policy_loss("dapoo")
    with pytest.raises(ValueError, match="importance_sampling_level='tokens'"):
        get_policy_loss("grpo", importance_sampling_level="tokens")


def test_build_from_flat_dict_drops_none_only():
    loss = build_policy_loss("dapo", {"epsilon": 0.1, "epsilon_high": None, "beta": 0.04})
    assert (loss.epsilon, loss.epsilon_high, loss.beta) == (0.1, 0.1, 0.04)
    assert policy_loss_parameters("dapo")["aggregation"] == "token-mean"
    assert policy_loss_parameters("cispo")["epsilon_high"] == 5.0


def test_import_path_plugin(tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(textwrap.dedent("""
        from cohort.algorithms import LossOutput

        def make(scale=1.0):
            def loss(inputs):
                return LossOutput(loss=scale * (inputs.logprobs * inputs.mask).sum(), metrics={})
            return loss
    """))
    (tmp_path / "my_dc_losses.py").write_text(textwrap.dedent("""
        from dataclasses import dataclass
        from cohort.algorithms import ClippedLoss

        @dataclass
        class MyLoss(ClippedLoss):
            my_scale: float = 1.0

            def objective(self, ctx):
                per_token, metrics = super().objective(ctx)
                return self.my_scale * per_token, metrics
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    # the dataclass plug-in keeps the shared pipeline: 3 x dapo's loss on AGG_LOGP is 3 * -0.25
    value, _, _ = run(get_policy_loss("my_dc_losses:MyLoss", my_scale=3.0), AGG_LOGP, [1.0, -2.0], mask=AGG_MASK)
    assert value == pytest.approx(-0.75)
    with pytest.raises(ValueError, match="Did you mean 'my_scale'"):
        build_policy_loss("my_dc_losses:MyLoss", {"my_scal": 2.0})
    loss_fn = get_policy_loss("my_losses:make", scale=2.0)
    value, grad, _ = run(loss_fn, [[1.0, 2.0]], [0.0])
    assert value == 6.0 and grad.tolist() == [[2.0, 2.0]]
    sys.modules.pop("my_losses", None)
    sys.modules.pop("my_dc_losses", None)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_policy_loss("cohort.algorithms:nope")


def test_reduce_metrics_rules():
    parts = [{"clip_ratio/low_mean": torch.tensor(0.25), "clip_ratio/low_min": torch.tensor(0.5),
              "clip_ratio/high_max": torch.tensor(float("nan"))},
             {"clip_ratio/low_mean": torch.tensor(0.5), "clip_ratio/low_min": torch.tensor(0.2),
              "clip_ratio/high_max": torch.tensor(0.7)}]
    assert reduce_metrics(parts) == pytest.approx(
        {"clip_ratio/low_mean": 0.75, "clip_ratio/low_min": 0.2, "clip_ratio/high_max": 0.7})


def test_missing_inputs_named():
    with pytest.raises(ValueError, match=r"needs LossInputs\.ref_logprobs"):
        run(get_policy_loss("dapo", beta=0.1), [[0.0]], [1.0])
    with pytest.raises(ValueError, match=r"needs LossInputs\.entropy"):
        run(get_policy_loss("dapo", entropy_coef=0.1), [[0.0]], [1.0])


@pytest.mark.parametrize("name", list_policy_losses())
def test_fully_masked_batch_gives_zero_not_nan(name):
    # no loss token anywhere: every normaliser is clamped to 1, so the loss is 0 / 1 = 0 with a zero gradient
    value, grad, _ = run(get_policy_loss(name), [[-1.0, -2.0]], [1.0], mask=[[0, 0]], max_completion_length=4,
                         num_tokens=0, num_sequences=0)
    assert value == 0.0 and grad.abs().sum().item() == 0.0

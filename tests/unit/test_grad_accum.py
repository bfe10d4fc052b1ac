"""Gradient accumulation is exact: uneven micro-batches with the global counts give the whole-batch loss,
gradient and (reduced) metrics, for every registered loss and the options that touch normalisation."""

import pytest
import torch

from cohort.algorithms import (
    LossInputs,
    entropy_quantile_threshold,
    get_policy_loss,
    high_entropy_mask,
    list_policy_losses,
    reduce_metrics,
)

B, T, MAX_LEN = 7, 6, 8
SPLITS = [(0, 1), (1, 4), (4, 7)]  # 1, 3 and 3 rows: deliberately unequal micro-batches

OPTIONS = {
    "plain": {},
    "kl+entropy": {"beta": 0.05, "entropy_coef": 0.01},
    "sequence-level": {"importance_sampling_level": "sequence", "beta": 0.02},
    "sampler-is": {"sampler_is_mode": "token_truncate", "sampler_is_clip_min": 0.5, "sampler_is_clip_max": 2.0},
    "top-entropy": {"top_entropy_quantile": 0.5, "entropy_coef": 0.02},
}


def make_batch():
    g = torch.Generator().manual_seed(0)
    d = torch.float64
    lengths = torch.tensor([6, 2, 4, 1, 5, 3, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(d)
    logp = -torch.rand(B, T, generator=g, dtype=d) * 2
    old = logp + 0.25 * torch.randn(B, T, generator=g, dtype=d)
    return dict(
        logprobs=logp, mask=mask, old_logprobs=old,
        advantages=torch.randn(B, generator=g, dtype=d),
        ref_logprobs=logp + 0.1 * torch.randn(B, T, generator=g, dtype=d),
        sampling_logprobs=old + 0.1 * torch.randn(B, T, generator=g, dtype=d),
        entropy=torch.rand(B, T, generator=g, dtype=d) * 2,
    )


def run(loss_fn, batch, rows, **global_counts):
    logp = batch["logprobs"][rows].clone().requires_grad_(True)
    ent = batch["entropy"][rows].clone().requires_grad_(True)
    fields = {k: v[rows] for k, v in batch.items() if k not in ("logprobs", "entropy")}
    out = loss_fn(LossInputs(logprobs=logp, entropy=ent, max_completion_length=MAX_LEN, **fields, **global_counts))
    out.loss.backward()
    return out, logp.grad, ent.grad


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list_policy_losses())
def test_micro_batches_equal_whole_batch(name, option):
    params = dict(OPTIONS[option])
    if name == "vespo" and option == "sampler-is":
        params["sampler_is_mode"] = "token_mask"
    loss_fn = get_policy_loss(name, **params)
    batch = make_batch()
    whole, whole_grad, whole_ent_grad = run(loss_fn, batch, slice(0, B))

    counts = {"num_tokens": batch["mask"].sum(), "num_sequences": B}
    if params.get("top_entropy_quantile", 1.0) < 1.0:
        # the selection threshold and the bonus's token count must be the step's, not each micro-batch's
        thr = entropy_quantile_threshold(batch["entropy"], batch["mask"], params["top_entropy_quantile"])
        counts["entropy_threshold"] = thr
        counts["num_entropy_tokens"] = high_entropy_mask(batch["entropy"], batch["mask"], thr).sum()
    total, grads, ent_grads, metrics = 0.0, [], [], []
    for lo, hi in SPLITS:
        out, g, eg = run(loss_fn, batch, slice(lo, hi), **counts)
        total = total + out.loss.item()
        grads.append(g)
        ent_grads.append(eg)
        metrics.append(out.metrics)

    assert total == pytest.approx(whole.loss.item(), abs=1e-12, rel=1e-10)
    torch.testing.assert_close(torch.cat(grads), whole_grad, atol=1e-12, rtol=1e-10)
    if whole_ent_grad is not None:
        torch.testing.assert_close(torch.cat(ent_grads), whole_ent_grad, atol=1e-12, rtol=1e-10)
    reduced, expected = reduce_metrics(metrics), reduce_metrics([whole.metrics])
    assert reduced.keys() == expected.keys()
    for key, value in expected.items():
        assert reduced[key] == pytest.approx(value, abs=1e-12, rel=1e-10, nan_ok=True), key


def test_local_counts_would_not_be_exact():
    """Guard that the test above can fail: per-micro-batch normalisation (TRL's bnpo) differs here."""
    loss_fn = get_policy_loss("bnpo")
    batch = make_batch()
    whole, _, _ = run(loss_fn, batch, slice(0, B))
    local = sum(run(loss_fn, batch, slice(lo, hi))[0].loss.item() / len(SPLITS) for lo, hi in SPLITS)
    assert abs(local - whole.loss.item()) > 1e-3, (local, whole.loss.item())

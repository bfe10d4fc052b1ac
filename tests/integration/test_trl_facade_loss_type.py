"""GRPOConfig(loss_type=...) reaches the loss that trains: each TRL loss type builds its own loss class and
aggregation, and the step's metrics are that loss's own (a facade that dropped or hard-coded loss_type would
build one loss for every name, which the pairwise check below catches)."""

from __future__ import annotations

import itertools

import pytest
from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import digit_share, tiny_model, toy_rows

from cohort import GRPOConfig, GRPOTrainer
from cohort.algorithms.variants import CISPOLoss, ClippedLoss, SAPOLoss

# the TRL facade needs these today even with a list as train_dataset: it reads datasets through `datasets`
# (trl_compat/rows.py), and its config keeps cohort's default data.source, reasoning-gym's chain_sum, which the
# checks import
pytest.importorskip("datasets", reason="the TRL facade needs datasets: pip install datasets")
pytest.importorskip("reasoning_gym", reason="the TRL facade's checks need reasoning-gym: pip install reasoning-gym==0.1.25")

# loss_type -> (the class built, its aggregation, a metric only that loss logs, one it must not log)
EXPECTED = {
    "dr_grpo": (ClippedLoss, "seq-mean-token-sum-norm", "clip_ratio/region_mean", "cispo_clip_ratio"),
    "grpo": (ClippedLoss, "seq-mean-token-mean", "clip_ratio/region_mean", "cispo_clip_ratio"),
    "cispo": (CISPOLoss, "token-mean", "cispo_clip_ratio", "clip_ratio/region_mean"),
    "sapo": (SAPOLoss, "seq-mean-token-mean", None, "clip_ratio/region_mean"),
}


def train_one_step(tmp_path, loss_type: str) -> GRPOTrainer:
    tok = make_tiny_tokenizer()
    extra = {"epsilon_high": 4.0} if loss_type == "cispo" else {}  # cispo's cap eps_max, set as TRL users must
    args = GRPOConfig(output_dir=str(tmp_path / loss_type), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, report_to="jsonl", loss_type=loss_type,
                      extra={"train.device": "cpu"}, **extra)
    trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=digit_share, args=args, train_dataset=toy_rows(1),
                          processing_class=tok)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, GRPOTrainer]:
    root = tmp_path_factory.mktemp("losses")
    return {loss_type: train_one_step(root, loss_type) for loss_type in EXPECTED}


@pytest.mark.parametrize("loss_type", list(EXPECTED))
def test_loss_type_builds_its_loss(trained, loss_type):
    cls, aggregation, logged, not_logged = EXPECTED[loss_type]
    trainer = trained[loss_type]
    loss = trainer._comp.loss_fn  # the loss object the update called
    assert type(loss) is cls, (loss_type, type(loss).__name__)
    assert loss.aggregation == aggregation, (loss_type, loss.aggregation)
    metrics = trainer.result.history[0]
    if logged is not None:
        assert logged in metrics, (loss_type, sorted(metrics))
    assert not_logged not in metrics, (loss_type, sorted(metrics))


def test_different_loss_types_build_different_losses(trained):
    """A loss_type hard-coded (or dropped) in the facade's mapping builds one loss for every name."""
    for a, b in itertools.combinations(EXPECTED, 2):
        la, lb = trained[a]._comp.loss_fn, trained[b]._comp.loss_fn
        assert (type(la), la.aggregation) != (type(lb), lb.aggregation), (a, b)
    assert type(trained["dr_grpo"]._comp.loss_fn) is not type(trained["cispo"]._comp.loss_fn)
    assert trained["cispo"]._comp.loss_fn.epsilon_high == 4.0  # its own parameter reached it too

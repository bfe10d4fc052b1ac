"""The same script, run with `trl` and with `cohort` (only the import differs), on a tiny model on the CPU.

Both log the same metric names (cohort's rows hold TRL's and a few more). Sampling differs between the two, so
the first step's loss is compared where it does not depend on the samples: every completion runs to
max_completion_length (a random model that never says EOS), the step is on-policy (ratio 1), so TRL's dapo loss
-sum_i A_i |o_i| / sum_i |o_i| is -mean(A) = 0 for group-normalised advantages whatever the rewards; both must
log 0 within 1e-6. The loss on identical inputs is checked for every loss type in tests/unit/test_trl_crosscheck.py.
"""

from __future__ import annotations

import pytest
from tests.helpers.toy_task import toy_rows, write_toy_workspace

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _script(GRPOConfig, GRPOTrainer, model_dir, out):
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=2, logging_steps=1, learning_rate=1e-4, use_cpu=True, bf16=False, seed=0,
                      gradient_checkpointing=False, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=args,
                          train_dataset=datasets.Dataset.from_list(toy_rows(1)))
    trainer.train()
    return [row for row in trainer.state.log_history if "reward" in row]


def test_same_script_same_metric_names_and_first_loss(tmp_path):
    import cohort

    model_dir, _ = write_toy_workspace(tmp_path)
    theirs = _script(trl.GRPOConfig, trl.GRPOTrainer, model_dir, tmp_path / "trl")
    ours = _script(cohort.GRPOConfig, cohort.GRPOTrainer, model_dir, tmp_path / "cohort")
    assert len(theirs) == len(ours) == 2
    missing = set(theirs[0]) - set(ours[0])
    assert not missing, f"TRL logs {sorted(missing)}, cohort does not"
    assert [r["step"] for r in theirs] == [r["step"] for r in ours] == [1, 2]
    assert theirs[0]["completions/mean_length"] == ours[0]["completions/mean_length"] == 8  # no EOS: all run out
    assert abs(theirs[0]["loss"]) < 1e-6 and abs(ours[0]["loss"]) < 1e-6
    assert theirs[0]["learning_rate"] == pytest.approx(ours[0]["learning_rate"])  # linear decay, same schedule
    assert theirs[1]["epoch"] == pytest.approx(ours[1]["epoch"])

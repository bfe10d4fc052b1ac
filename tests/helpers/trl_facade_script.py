"""A TRL-style training script on cohort's facade, for tests/integration/test_trl_facade_torchrun.py.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/trl_facade_script.py MODEL OUT

Each rank writes OUT/rank-<r>.json: its TrainerState (global_step, log_history) and a checksum of its weights.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset
from tests.helpers.toy_task import digit_share, toy_rows

from cohort import GRPOConfig, GRPOTrainer  # was: from trl import GRPOConfig, GRPOTrainer


def main(model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    args = GRPOConfig(output_dir=f"{out}/run", per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-3, use_cpu=True,
                      bf16=False, gradient_checkpointing=False, report_to="none", save_steps=1, seed=0)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digit_share, args=args,
                          train_dataset=Dataset.from_list(toy_rows(1)))
    trainer.train()
    trainer.save_model(f"{out}/final")
    rank = int(os.environ.get("RANK", "0"))
    weights = sum(float(p.double().abs().sum()) for p in trainer.model.parameters())
    state = {"global_step": trainer.state.global_step, "world": trainer.accelerator.num_processes,
             "is_world_process_zero": trainer.is_world_process_zero(), "weights": weights,
             "prompts_per_step": trainer.config.train.prompts_per_step,
             "log_history": trainer.state.log_history}
    with open(f"{out}/rank-{rank}.json", "w") as f:
        json.dump(state, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

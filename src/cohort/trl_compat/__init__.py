"""A TRL-shaped front door: switch from TRL 1.16 by changing one import.

    from cohort import GRPOConfig, GRPOTrainer          # was: from trl import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="smollm2-135m-instruct", reward_funcs=my_reward,
                          train_dataset=rows, args=GRPOConfig(output_dir="runs/x", num_generations=8))
    trainer.train()

`GRPOConfig` has every field of TRL 1.16's GRPOConfig (and the TrainingArguments it inherits) with TRL's
defaults; `fields.TABLE` says, field by field, whether it is mapped onto cohort's config, announced (accepted,
one log line) or rejected (ConfigError naming the alternative); docs/trl_compat.md is generated from it. The
trainer then runs the very same loop as `cohort train`.
"""

from cohort.trl_compat.config import GRPOConfig
from cohort.trl_compat.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]

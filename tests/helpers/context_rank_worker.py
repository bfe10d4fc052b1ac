"""One rank of a toy GRPO run with context parallelism, launched by `python -m torch.distributed.run` (gloo, CPU),
for tests/integration/test_context_parallel.py.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/context_rank_worker.py \
        OUT SHARDING STEPS CONTEXT_PARALLEL

As tests/helpers/rank_worker.py (the toy task, a global batch of 8 prompts x 4 completions whatever N, weights
written to OUT/weights-<rank>.pt, rank 0's metrics to OUT/run/metrics.jsonl), with train.context_parallel set and
train.share_prompts off (context parallelism refuses it; the 1-rank baseline runs without it too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the script runs by path under torchrun: `tests` must import
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from tests.helpers.rank_worker import PROMPTS_PER_STEP, full_params  # noqa: E402


def main(out: str, sharding: str, steps: int, context_parallel: int) -> None:
    from tests.integration.test_trainer_learns import toy_components, toy_config

    from cohort import distributed
    from cohort.trainer import train

    torch.set_num_threads(1)
    info = distributed.init_from_env(timeout_s=120)
    cfg = toy_config(Path(out), steps=steps)
    cfg.train.device = "cpu"
    cfg.train.sharding = sharding
    cfg.train.prompts_per_step = PROMPTS_PER_STEP
    cfg.train.context_parallel = context_parallel
    cfg.train.share_prompts = False
    cfg.generation.num_generations = 4
    cfg.generation.max_completion_length = 8
    cfg.advantage.scale_rewards = "batch"  # needs every rank's rewards: exercises the gather
    comp = toy_components(cfg)
    train(cfg, comp, echo=lambda *a, **k: None)
    params = full_params(comp.policy)
    torch.save(params, os.path.join(out, f"weights-{info.rank}.pt"))
    distributed.shutdown()  # a barrier first: no rank ends its group while a peer still communicates


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

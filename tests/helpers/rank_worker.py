"""One rank of a toy GRPO run launched by `python -m torch.distributed.run` (gloo, CPU), for the many-rank
launch tests (tests/integration/test_eight_ranks.py).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/helpers/rank_worker.py OUT SHARDING STEPS \
        [CONTEXT_PARALLEL]

Trains the toy task of tests/integration/test_trainer_learns.py with a global batch that does not depend on N
(train.prompts_per_step=8, 4 completions each), joins the process group as the CLI does
(cohort.distributed.init_from_env), and writes OUT/weights-<rank>.pt: the whole parameters of the rank's
policy (FSDP shards gathered) after the last step. Rank 0 writes OUT/run/metrics.jsonl. With CONTEXT_PARALLEL
(tests/integration/test_context_parallel.py), train.context_parallel is set and train.share_prompts is off
(context parallelism refuses it; the 1-rank baseline runs without it too).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the script runs by path under torchrun: `tests` must import
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

PROMPTS_PER_STEP = 8  # one prompt per rank on 8 ranks; every N in (1, 2, 4, 8) divides it


def full_params(model) -> dict[str, torch.Tensor]:
    """Whole parameters by their unsharded names (every rank must call it: DTensor.full_tensor gathers)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = t.detach().clone()
    return out


def main(out: str, sharding: str, steps: int, context_parallel: int | None = None) -> None:
    from tests.integration.test_trainer_learns import toy_components, toy_config

    from cohort import distributed
    from cohort.trainer import train

    torch.set_num_threads(1)
    info = distributed.init_from_env(timeout_s=120)
    cfg = toy_config(Path(out), steps=steps)
    cfg.train.device = "cpu"
    cfg.train.sharding = sharding
    cfg.train.prompts_per_step = PROMPTS_PER_STEP
    if context_parallel is not None:
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
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)

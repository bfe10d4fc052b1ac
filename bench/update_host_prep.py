"""Host time of the update's start, before its first micro-batch reaches the GPU (CPU only, no model).

    PYTHONPATH=src python3 bench/update_host_prep.py

The GPU idles while the host counts the step's loss tokens, cuts micro-batches, builds the first one's masks and
engine logprobs (`PolicyUpdater._host_tensors`) and its shared-prompt layout (`pack_shared_layout`). This times
each part on the bench workload's shapes (32 prompts of 128 tokens x 8 completions of 256, 33,024-token budget,
shared prompts): the median of 30 runs, in ms.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from cohort.forward.shared_prompts import pack_shared_layout
from cohort.rollout import RolloutBatch
from cohort.update import PolicyUpdater, UpdateSettings


def median_ms(fn, repeats: int = 30) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(150000) for _ in range(128)] for _ in range(32)]
    n = 256
    batch = RolloutBatch(
        prompt_ids=[p for p in prompts for _ in range(8)],
        completion_ids=[[rng.randrange(150000) for _ in range(256)] for _ in range(n)],
        sampling_logprobs=[[-rng.random() for _ in range(256)] for _ in range(n)],
        finish_reasons=["length"] * n, completions_text=[""] * n, prompts=[None] * n,
        rewards_per_func=torch.zeros(n, 1), rewards=torch.zeros(n), advantages=torch.randn(n),
        loss_mask_keep=[True] * n, group_size=8)
    updater = PolicyUpdater(torch.nn.Linear(2, 2), None, None, None,
                            UpdateSettings(1, 1, 33024, 1.0, 1.0, 256, share_prompts=True))
    rows = list(range(n))
    first = [rows[i] for i in updater._micro_batches(batch, rows)[0]]
    count = getattr(batch, "loss_token_count", None)
    parts = {
        "loss-token count": (lambda: sum(count(r) for r in rows)) if count else
        (lambda: sum(sum(batch.token_mask(r)) for r in rows)),
        "micro-batches": lambda: updater._micro_batches(batch, rows),
        "masks and engine logprobs": lambda: updater._host_tensors(batch, first, 256),
        "shared-prompt layout": lambda: pack_shared_layout([(batch.prompt_ids[r], batch.completion_ids[r])
                                                            for r in first]),
    }
    times = {name: median_ms(fn) for name, fn in parts.items()}
    print(f"| part ({len(first)} rows in the first micro-batch) | ms |\n| --- | ---: |")
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"| all | {sum(times.values()):.2f} |")


if __name__ == "__main__":
    main()

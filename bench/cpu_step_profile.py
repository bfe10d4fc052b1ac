"""Time one step's phases of the default recipe on this machine: generate (cohort engine vs HF generate),
packed forward, backward, optimiser step. CPU-friendly; prints one line per phase.

    python bench/cpu_step_profile.py                       # cohort engine (the default)
    python bench/cpu_step_profile.py generation.engine=hf  # Hugging Face generate
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from cohort.config import load_config
from cohort.forward.packing import packed_forward_logprobs
from cohort.setup import build_components


def main(overrides: list[str]) -> None:
    cfg = load_config("recipes/default.yaml", ["data.eval_size=0", "train.max_steps=1", *overrides])
    comp = build_components(cfg)
    batch = comp.train_data.batch(list(range(cfg.train.prompts_per_step)))
    params = dataclasses.replace(comp.sampling_params, seed=1)
    for attempt in ("generate (first)", "generate"):
        t = time.perf_counter()
        groups = comp.engine.generate(batch.prompt_ids, params)
        print(f"{attempt}: {time.perf_counter() - t:.2f} s, engine {type(comp.engine).__name__}")
    seqs = [(batch.prompt_ids[i], c.token_ids) for i, g in enumerate(groups) for c in g]
    t = time.perf_counter()
    out = packed_forward_logprobs(comp.policy, seqs, temperature=1.0)
    print(f"forward: {time.perf_counter() - t:.2f} s for {sum(len(p) + len(c) for p, c in seqs)} tokens")
    t = time.perf_counter()
    out.logprobs.sum().backward()
    print(f"backward: {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    comp.optimizer.step()
    print(f"optimizer: {time.perf_counter() - t:.2f} s; torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Held-out accuracy of the served learning runs (bench/serve_learning_seeds.sh): one row per seed and k, then
the mean, the standard error over the seeds and, for every k > 0, the k minus k = 0 difference at every evaluation.

    python3 bench/serve_learning_table.py FOLDER [FOLDER ...]

Each FOLDER holds `seed<S>_k<K>_metrics.jsonl` files (a run's metrics.jsonl: evaluation lines carry
`eval/accuracy`, training lines `reward`). Runs from several folders are pooled.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

NAME = re.compile(r"seed(\d+)_k(\d+)_metrics\.jsonl$")


def read_run(path: Path) -> tuple[dict[int, float], list[float]]:
    """(held-out accuracy by step, training reward per step) of one metrics.jsonl."""
    evals: dict[int, float] = {}
    rewards: list[float] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "eval/accuracy" in row:
            evals[int(row["step"])] = float(row["eval/accuracy"])
        elif "reward" in row:
            rewards.append(float(row["reward"]))
    return evals, rewards


def mean_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, float("nan")
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def main(folders: list[str]) -> None:
    runs: dict[tuple[int, int], tuple[dict[int, float], list[float]]] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("seed*_k*_metrics.jsonl")):
            match = NAME.search(path.name)
            if match:
                runs[(int(match.group(1)), int(match.group(2)))] = read_run(path)
    if not runs:
        sys.exit(f"no seed<S>_k<K>_metrics.jsonl in {folders}")
    steps = sorted(set.intersection(*(set(evals) for evals, _ in runs.values())))
    print("| run | " + " | ".join(f"step {s}" for s in steps) + " | train reward, last 50 steps |")
    print("| --- |" + " ---: |" * (len(steps) + 1))
    for (seed, k), (evals, rewards) in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0])):
        tail = rewards[-50:]
        cells = " | ".join(f"{100 * evals[s]:.2f}%" for s in steps)
        print(f"| seed {seed}, k = {k} | {cells} | {sum(tail) / max(len(tail), 1):.3f} |")
    by_k = {k: [evals for (_, kk), (evals, _) in runs.items() if kk == k] for k in sorted({k for _, k in runs})}
    for k, group in by_k.items():
        cells = []
        for s in steps:
            m, se = mean_se([100 * evals[s] for evals in group])
            cells.append(f"{m:.2f} ± {se:.2f}")
        print(f"| mean ± s.e., k = {k} ({len(group)} seeds) | " + " | ".join(cells) + " | |")
    # The paired difference: seeds that ran with both k share their data order and initial model.
    for k in [k for k in by_k if k > 0]:
        seeds = sorted({seed for seed, kk in runs if kk == k and (seed, 0) in runs})
        if not seeds:
            continue
        cells = []
        for s in steps:
            m, se = mean_se([100 * (runs[(seed, k)][0][s] - runs[(seed, 0)][0][s]) for seed in seeds])
            cells.append(f"{m:+.2f} ± {se:.2f}")
        print(f"| k = {k} minus k = 0, paired ({len(seeds)} seeds) | " + " | ".join(cells) + " | |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

"""Re-count the update MFU of saved bench/grpo_step.py results with bench/flops.py's FLOPs.

    python3 bench/mfu_recount.py bench/results/*/grpo-step-*.json

Until 2026-11-27 grpo_step.py counted 6 x all parameters x all tokens, the LM head on prompt tokens too,
whose logits neither trainer computes. This prints, per row of each file, the update seconds, that count's MFU
(as the file recorded it) and the MFU of bench/flops.py's count. Needs no GPU (nor torch's CUDA build).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flops import update_flops
from grpo_step import PEAK_FLOPS, SIZES


def recount(path: str) -> list[tuple[str, str, float, float, float]]:
    """(size, runner, update s, recorded MFU, re-counted MFU) of each measured row of a results file."""
    with open(path) as fh:
        data = json.load(fh)
    args, rows = data["args"], []
    for size, runners in data["results"].items():
        for runner, res in runners.items():
            summary, num_params = res.get("summary"), res.get("num_params")
            if not summary or not num_params:  # a failed row
                continue
            flops = update_flops(SIZES[size], num_params=num_params, tied=True,
                                 sequences=args["prompts"] * args["generations"], prompt_len=args["prompt_len"],
                                 completion_len=args["completion_len"],
                                 shared=args["generations"] if res.get("share_prompts") else 1)
            rows.append((size, runner, summary["update"], summary.get("mfu_6n", summary["mfu"]),
                         flops / summary["update"] / PEAK_FLOPS))
    return rows


def main(paths: list[str]) -> None:
    print("| results | model | runner | update s | MFU, 6 N per token | MFU, bench/flops.py |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for path in paths:
        for size, runner, update, old, new in recount(path):
            print(f"| {os.path.basename(path)} | {size} | {runner} | {update:.3f} | {100 * old:.1f}% | {100 * new:.1f}% |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])

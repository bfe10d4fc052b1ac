"""One toy GRPO run in its own process, for the determinism tests (tests/gpu/test_deterministic_gpu.py).

    python tests/helpers/deterministic_run.py OUT DEVICE STEPS [section.field=value ...]

Trains tests/integration/test_trainer_learns.py's toy task for STEPS steps on DEVICE with the overrides, then
writes OUT/result.json: every step's metrics (wall-clock ones left out) and a SHA-256 of the final weights'
bytes. A process of its own because train.deterministic must take effect before CUDA starts.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run by path: `tests` must import
    sys.path.insert(0, str(REPO))

VOLATILE = ("time", "step_time", "time/", "train_time", "throughput", "tokens_per_s", "mfu")


def weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(out: str, device: str, steps: int, overrides: list[str]) -> None:
    from tests.integration.test_trainer_learns import toy_components, toy_config

    from cohort.config import apply_overrides
    from cohort.run.logging import read_jsonl
    from cohort.trainer import train

    cfg = apply_overrides(toy_config(Path(out), steps=steps), [f"train.device={device}", *overrides])
    comp = toy_components(cfg)
    train(cfg, comp, echo=lambda *a, **k: None)
    rows = [{k: v for k, v in r.items() if not k.startswith(VOLATILE)}
            for r in read_jsonl(Path(out) / "run" / "metrics.jsonl")]
    Path(out, "result.json").write_text(json.dumps({"metrics": rows, "weights_sha256": weights_hash(comp.policy)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])

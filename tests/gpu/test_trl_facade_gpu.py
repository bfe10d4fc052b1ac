"""The TRL facade on CUDA against TRL itself, on the same completions (tests/integration/test_trl_facade_vs_trl.py's
fixed-completion seam): the first step's loss and grad_norm of `trl.GRPOTrainer` and `cohort.GRPOTrainer` on the
GPU, in float32 and in bf16. Prints a table; float32 must agree as on the CPU (1e-4 relative), bf16 within 5e-2
(TRL runs bf16=True through accelerate's mixed precision, cohort trains bf16 weights with fp32 master weights: the
two round differently; the table says by how much).

    python -m pytest tests/gpu/test_trl_facade_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
trl = pytest.importorskip("trl", reason="compares with TRL itself: pip install trl==1.16.0")
# the facade's config keeps cohort's default data.source (reasoning-gym's chain_sum), which its checks import
pytest.importorskip("reasoning_gym", reason="needs reasoning-gym: pip install reasoning-gym==0.1.25 (a GPU machine "
                                            "without the index: pip install --no-deps .gl/rg/*.whl)")

_KEYS = ("loss", "grad_norm", "entropy", "reward", "reward_std")


@pytest.mark.parametrize(("bf16", "rel"), [(False, 1e-4), (True, 5e-2)], ids=["float32", "bf16"])
def test_first_step_on_cuda_equals_trls_on_the_same_completions(tmp_path, bf16, rel):
    from tests.integration.test_trl_facade_vs_trl import _fixed_script, write_toy_workspace

    import cohort

    model_dir, _ = write_toy_workspace(tmp_path)
    kw = dict(use_cpu=False, bf16=bf16)
    theirs = _fixed_script(trl.GRPOConfig, trl.GRPOTrainer, model_dir, tmp_path / "trl", [], **kw)
    ours = _fixed_script(cohort.GRPOConfig, cohort.GRPOTrainer, model_dir, tmp_path / "cohort", [], **kw)
    print(f"\n{'bf16' if bf16 else 'float32'} on {torch.cuda.get_device_name()}")
    print(f"{'metric':12s} {'trl':>14s} {'cohort':>14s} {'rel diff':>10s}")
    for key in _KEYS:
        a, b = float(theirs[key]), float(ours[key])
        print(f"{key:12s} {a:14.7g} {b:14.7g} {abs(a - b) / max(abs(a), 1e-12):10.2e}")
    for key in _KEYS:
        assert ours[key] == pytest.approx(theirs[key], rel=rel, abs=1e-6), key

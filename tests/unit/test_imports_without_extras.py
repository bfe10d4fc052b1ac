"""Every module imports on an install without the optional packages (the README's CPU install has no Triton,
and peft, datasets, reasoning-gym, math-verify, matplotlib, TensorBoard, FlashAttention-4, gguf and
bitsandbytes are extras): the features that need them import them where they run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("triton", "peft", "datasets", "reasoning_gym", "math_verify", "matplotlib", "tensorboard",
          "flash_attn", "gguf", "trl", "bitsandbytes")

SCRIPT = f"""
import importlib, pkgutil, sys

# None in sys.modules: `import x` raises ModuleNotFoundError and importlib.util.find_spec("x") answers None,
# exactly as on a machine where the package is not installed
for name in {HIDDEN!r} + ("torch.utils.tensorboard",):
    sys.modules[name] = None
import cohort
bad = []
for info in pkgutil.walk_packages(cohort.__path__, "cohort."):
    try:
        importlib.import_module(info.name)
    except Exception as exc:
        bad.append(f"{{info.name}}: {{type(exc).__name__}}: {{exc}}")
print("\\n".join(bad) or "all imported")
sys.exit(1 if bad else 0)
"""


def test_every_module_imports_without_the_optional_packages():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]

"""bench/ scripts imported as modules by the CPU tests (bench/ is not a package: each script is loaded from its
path, with bench/ on sys.path while it loads, since some import their siblings)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str, name: str) -> ModuleType:
    """bench/`script` as a module named `name` (a name of its own, so it does not shadow a sibling's import)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / script)
        assert spec is not None and spec.loader is not None, script
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))

"""The pytest plugin bench/trl_suite.py loads (`-p trl_suite_plugin`) into the run of TRL's own test file.

It is imported before pytest collects the test file, so what it changes is what the file's imports see:

- `datasets.load_dataset("trl-internal-testing/zen", config, split=..., streaming=...)` (and `zen-image`,
  `zen-multi-image`) answers from the stand-ins bench/trl_suite_standins.py saved under the cache; any other
  name goes to the real `load_dataset` (which, offline, fails as it would without a network);
- in facade mode (`COHORT_TRL_SUITE_MODE=facade`) `trl.GRPOTrainer` and `trl.GRPOConfig` are cohort's
  (`cohort.trl_compat`), so the test file's `from trl import GRPOConfig, GRPOTrainer` gets the facade; nothing
  else of `trl` changes;
- with `COHORT_TRL_SUITE_MAX_STEPS=N` (`run --max-steps N`) a config that would train for num_train_epochs
  trains N optimiser steps instead, in both modes alike;
- every test runs under an alarm (`COHORT_TRL_SUITE_TEST_TIMEOUT_S`, default 300 s) so one hung test fails with
  a reason instead of stopping the suite;
- without torchvision, a processor's video processor may be absent (bench/trl_suite_vlm.py's
  `allow_image_only_processors`, in both modes alike): transformers 5 cannot otherwise load the processors of
  the Qwen2-VL, Qwen2.5-VL, Qwen3.5 and Gemma 4 stand-ins, which take images only in these tests;
- an `is_<package>_available` that TRL's test support imports from `trl.import_utils` but the installed trl
  lacks (the test file and trl are different releases) is defined as "the package imports";
- at the end of collection it writes `COHORT_TRL_SUITE_REPORT` (JSON): the mode and the classes the test module
  actually imported, which the harness checks (a facade run that tested TRL would be worthless).

The model ids need nothing here: the runner points `HF_HUB_CACHE` at the stand-ins' hub cache and sets
`HF_HUB_OFFLINE=1`, so transformers resolves them as downloaded repositories.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
from pathlib import Path

import datasets
import pytest
import trl
import trl.import_utils as trl_import_utils
from trl_suite_vlm import allow_image_only_processors  # the sibling module (bench/ is on PYTHONPATH)

MODE = os.environ.get("COHORT_TRL_SUITE_MODE", "trl")
CACHE = Path(os.environ.get("COHORT_TRL_SUITE_CACHE", Path(__file__).resolve().parent / ".cache" / "trl_suite"))
TEST_TIMEOUT_S = int(os.environ.get("COHORT_TRL_SUITE_TEST_TIMEOUT_S", "300"))
_real_load_dataset = datasets.load_dataset


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    """`datasets.load_dataset` with TRL's zen test datasets answered from the local stand-ins."""
    org, _, repo = str(path).partition("/")
    folder = CACHE / "datasets" / repo / str(name)
    if org != "trl-internal-testing" or not folder.is_dir():
        return _real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    data = datasets.load_from_disk(str(folder))
    if split is not None:
        data = data[split]
    if streaming:
        if isinstance(data, datasets.DatasetDict):
            return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in data.items()})
        return data.to_iterable_dataset()
    return data


datasets.load_dataset = load_dataset


def _shim_import_utils() -> list[str]:
    """The test support file may be newer or older than the installed trl: an `is_<pkg>_available` it imports
    from `trl.import_utils` that this trl lacks is defined as "the package can be imported" (what trl's own
    checks do), so the file imports; returns the names added (recorded in the report)."""
    support = CACHE / "trl-tests" / "tests" / "testing_utils.py"
    block = re.search(r"from trl\.import_utils import \(([^)]*)\)", support.read_text()) if support.is_file() else None
    added = []
    for name in re.findall(r"is_(\w+)_available", block.group(1) if block else ""):
        if not hasattr(trl_import_utils, f"is_{name}_available"):
            setattr(trl_import_utils, f"is_{name}_available",
                    lambda pkg=name: importlib.util.find_spec(pkg) is not None)
            added.append(f"is_{name}_available")
    return added


SHIMMED = _shim_import_utils() + (["video_processor optional"] if allow_image_only_processors() else [])

if MODE == "facade":
    from cohort import trl_compat  # the facade, only in facade mode

    trl.GRPOTrainer = trl_compat.GRPOTrainer
    trl.GRPOConfig = trl_compat.GRPOConfig


def _cap_max_steps(limit: int) -> None:
    """`COHORT_TRL_SUITE_MAX_STEPS` (`run --max-steps`, recorded with the results): a config
    that would train for num_train_epochs trains `limit` optimiser steps instead, in either mode (the class is
    the one the test file gets: cohort's in facade mode)."""
    cls = trl.GRPOConfig
    original = cls.__post_init__

    def post_init(self):
        if self.max_steps <= 0:
            self.max_steps = limit
        original(self)

    cls.__post_init__ = post_init


if os.environ.get("COHORT_TRL_SUITE_MAX_STEPS"):
    _cap_max_steps(int(os.environ["COHORT_TRL_SUITE_MAX_STEPS"]))


class _TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise _TestTimeout(f"the test ran past COHORT_TRL_SUITE_TEST_TIMEOUT_S={TEST_TIMEOUT_S} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def pytest_collection_finish(session):
    report = os.environ.get("COHORT_TRL_SUITE_REPORT")
    if not report:
        return
    seen = {}
    for item in session.items:
        module = getattr(item, "module", None)
        for name in ("GRPOTrainer", "GRPOConfig"):
            cls = getattr(module, name, None)
            if cls is not None:
                seen[name] = f"{cls.__module__}.{cls.__qualname__}"
        if seen:
            break
    Path(report).write_text(json.dumps({"mode": MODE, "imported": seen, "collected": len(session.items),
                                          "shimmed": SHIMMED}))

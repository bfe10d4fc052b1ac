"""TRL's own `tests/test_grpo_trainer.py` against cohort's facade, CI-sized (issue 36; bench/trl_suite.py).

`test_the_ci_sample_of_trl_tests_passes_against_the_facade` runs the fixed sample `trl_suite.SAMPLE` (TRL tests
the facade passes: construction, TRL's errors and warnings, its loss helpers, evaluation datasets, and, trained for
`SAMPLE_MAX_STEPS` steps, tools, environments, generation_kwargs, reward logging, GPT-OSS and Gemma 2) through the
harness in facade mode, offline, and requires every one to pass, on the unmodified copy of TRL's test files in
third_party/trl (or a newer one that COHORT_TRL_TESTS names).

The other tests check the harness itself on a stand-in test file, with no TRL checkout: that facade mode
really hands the test file cohort's classes (and TRL mode TRL's), that the `zen` stand-ins load under TRL's
names with TRL's columns, and how results are read and summarised.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="runs TRL's own tests: pip install trl==1.16.0")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import trl_suite  # noqa: E402  (bench/ is not a package: its scripts import their siblings by path)
import trl_suite_standins  # noqa: E402

STAND_IN_TEST = '''
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer


def test_classes():
    print("CLASSES", GRPOTrainer.__module__, GRPOConfig.__module__)


def test_zen():
    train = load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="train")
    chat = load_dataset("trl-internal-testing/zen", "conversational_prompt_only")
    stream = load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="test", streaming=True)
    assert train.column_names == ["prompt"] and len(train) == 17 and isinstance(train[0]["prompt"], str)
    assert chat["test"][0]["prompt"][0]["role"] == "user" and len(chat["test"]) == 2
    assert type(stream).__name__ == "IterableDataset"


def test_fails():
    assert False, "planted failure"
'''


@pytest.fixture(scope="module")
def stand_in_suite(tmp_path_factory):
    """A folder shaped like TRL's tests/ with a stand-in test file, and a cache holding the zen stand-ins."""
    root = tmp_path_factory.mktemp("suite")
    cache, folder = root / "cache", root / "trl-tests" / "tests"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / trl_suite.TEST_FILE).write_text(STAND_IN_TEST)
    (folder.parent / "pytest.ini").write_text("[pytest]\n")
    trl_suite_standins.build_datasets(cache / "datasets")
    return folder, cache


@pytest.mark.parametrize("mode", ["trl", "facade"])
def test_each_mode_hands_the_test_file_its_classes(stand_in_suite, tmp_path, mode):
    folder, cache = stand_in_suite
    run = trl_suite.run_mode(mode, folder, tmp_path, cache=cache)
    expected = "cohort.trl_compat.trainer.GRPOTrainer" if mode == "facade" else "trl.trainer.grpo_trainer.GRPOTrainer"
    assert run["imported"]["GRPOTrainer"] == expected
    outcomes = {t: r["outcome"] for t, r in run["tests"].items()}
    assert outcomes == {"test_classes": "passed", "test_zen": "passed", "test_fails": "failed"}
    assert run["tests"]["test_fails"]["reason"].startswith("AssertionError: planted failure")


def test_summary_counts_and_groups_facade_failures_among_tests_trl_passes():
    def tests(**outcomes):
        return {t: {"outcome": o, "reason": f"ValueError: bad {t} 3" if o == "failed" else "", "seconds": 0.0}
                for t, o in outcomes.items()}

    trl = {"mode": "trl", "tests": tests(a="passed", b="passed", c="passed", d="failed", e="skipped")}
    facade = {"mode": "facade", "tests": tests(a="passed", b="failed", c="failed", d="failed", e="skipped")}
    summary = trl_suite.summarize(trl, facade)
    assert summary["applicable"] == 3 and summary["facade_passed"] == 1
    assert set(summary["not_applicable"]) == {"d", "e"}
    assert summary["facade_causes"] == {"ValueError: bad b N": ["b"], "ValueError: bad c N": ["c"]}
    assert summary["counts"]["facade"] == {"passed": 1, "failed": 3, "skipped": 1, "xfailed": 0}
    private = next(iter(trl_suite.TRL_PRIVATE))  # a facade failure of a TRL-private test is listed, not counted
    trl["tests"][private] = {"outcome": "passed", "reason": "", "seconds": 0.0}
    facade["tests"][private] = {"outcome": "failed", "reason": "AttributeError: _generate", "seconds": 0.0}
    with_private = trl_suite.summarize(trl, facade)
    assert with_private["trl_private"] == {private: trl_suite.TRL_PRIVATE[private]}
    assert with_private["applicable"] == 4 and with_private["facade_passed"] == 1
    assert private not in with_private["facade_failed"]
    section = trl_suite.markdown(summary, trl, facade, {}, "bench/results/x")
    assert section.startswith(trl_suite.DOCS_BEGIN) and section.endswith(trl_suite.DOCS_END)
    assert "| facade | 1 | 3 | 1 | 0 |" in section


def test_docs_section_is_replaced_in_place(tmp_path):
    doc = tmp_path / "trl_compat.md"
    doc.write_text("# title\n\nintro\n")
    trl_suite.write_docs(f"{trl_suite.DOCS_BEGIN}\none\n{trl_suite.DOCS_END}", doc)
    trl_suite.write_docs(f"{trl_suite.DOCS_BEGIN}\ntwo\n{trl_suite.DOCS_END}", doc)
    text = doc.read_text()
    assert text.count("## TRL's own test suite") == 1 and "two" in text and "one" not in text


def test_the_repository_keeps_trls_test_files_unmodified():
    """third_party/trl holds TRL's files byte for byte: the SHA-256 its README records."""
    readme = (ROOT / "third_party" / "trl" / "README.md").read_text()
    for name in trl_suite.TEST_SUPPORT:
        digest = hashlib.sha256((trl_suite.VENDORED / name).read_bytes()).hexdigest()
        assert f"| tests/{name} | `{digest}` |" in readme, name


def test_the_ci_sample_of_trl_tests_passes_against_the_facade(tmp_path):
    folder = trl_suite.prepare(None)
    run = trl_suite.run_mode("facade", folder, tmp_path, list(trl_suite.SAMPLE), max_steps=trl_suite.SAMPLE_MAX_STEPS)
    assert run["imported"]["GRPOTrainer"] == "cohort.trl_compat.trainer.GRPOTrainer"
    assert len(trl_suite.SAMPLE) >= 20 and set(run["tests"]) == set(trl_suite.SAMPLE), json.dumps(run["tests"])
    failed = {t: r["reason"] for t, r in run["tests"].items() if r["outcome"] != "passed"}
    assert not failed, json.dumps(failed, indent=1)

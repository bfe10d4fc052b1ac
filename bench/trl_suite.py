"""TRL's own `tests/test_grpo_trainer.py`, run offline against TRL and against cohort's facade (issue 36).

    python3 bench/trl_suite.py prepare --trl-tests PATH   # once: TRL's tests/ folder (a checkout of
                                                          # huggingface/trl) copied into the cache; stand-ins built
    python3 bench/trl_suite.py run                        # both modes, all tests: results + docs/trl_compat.md
    python3 bench/trl_suite.py run --mode facade --sample # the CI sample (SAMPLE) against the facade only
    python3 bench/trl_suite.py run --max-steps 3          # tests that train for epochs train 3 steps (both modes)

Nothing is fetched at run time. `prepare` copies the five files the test file needs (`__init__.py`,
`conftest.py`, `testing_utils.py`, `testing_constants.py`, `test_grpo_trainer.py`) into
`bench/.cache/trl_suite/trl-tests/tests/` (git-ignored, as `.cache/` is) and builds the Hub stand-ins there
(bench/trl_suite_standins.py: tiny random models with the real Qwen3 tokenizer in a local hub cache, the
vision-language models with their processors (bench/trl_suite_vlm.py), the `zen` datasets). The files come from
`--trl-tests DIR` or `COHORT_TRL_TESTS` (a newer TRL checkout), else from the unmodified copy in third_party/trl
(TRL's Apache-2.0 licence and the commit are there; the results record the test file's SHA-256).

`run` starts pytest once per mode in a subprocess with `HF_HUB_OFFLINE=1`, the stand-ins' hub cache and the
plugin bench/trl_suite_plugin.py (which, in facade mode, puts cohort's `GRPOTrainer`/`GRPOConfig` in `trl`'s
place before the test file imports them), reads each run's JUnit XML, and writes
`bench/results/<date>-trl-suite/results.json` with bench/manifest.py's manifest, plus the summary table in
docs/trl_compat.md ("TRL's own test suite"), unless `--no-write`.

A test is *not applicable* when it does not pass with TRL itself here (it needs vLLM, Liger, a GPU, jmespath,
or a stand-in that is not built): only tests that pass with TRL count for the facade.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from manifest import command_line, new_run_folder, write_manifest  # the sibling bench/manifest.py

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CACHE = BENCH / ".cache" / "trl_suite"
TEST_FILE = "test_grpo_trainer.py"
TEST_SUPPORT = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py", TEST_FILE)
DOCS = ROOT / "docs" / "trl_compat.md"
VENDORED = ROOT / "third_party" / "trl" / "tests"  # TRL's five files, unmodified (third_party/trl/README.md)
DOCS_BEGIN, DOCS_END = "<!-- trl-suite:begin (generated: python3 bench/trl_suite.py run) -->", "<!-- trl-suite:end -->"
STANDINS_VERSION = 2  # bump when bench/trl_suite_standins.py changes what it builds
# The CI sample (tests/integration/test_trl_suite.py): TRL tests the facade passes that train little or not at
# all, so the sample runs in minutes on a 2-core CPU: construction with each kind of dataset and reward model,
# TRL's errors and warnings with its wording, argument normalisation, and TRL's loss helpers.
SAMPLE = (
    *(f"TestGetHighEntropyMask::{t}" for t in (
        "test_compute_entropy_mask_0", "test_compute_entropy_mask_1", "test_compute_entropy_mask_lower_threshold",
        "test_compute_entropy_threshold_0", "test_compute_entropy_threshold_1", "test_compute_entropy_all_masked")),
    *(f"TestGRPOTrainer::{t}" for t in (
        "test_init_minimal", "test_trust_remote_code",
        *(f"test_init_with_eval_dataset[{k}]" for k in ("dataset", "iterable_dataset", "dataset_dict",
                                                         "iterable_dataset_dict", "dict_of_dataset",
                                                         "dict_of_iterable_dataset", "none")),
        "test_iterable_dataset_requires_dispatch_batches_false", "test_iterable_dataset_forces_num_workers_zero",
        "test_iterable_eval_keeps_map_style_train_workers", "test_get_off_policy_mask",
        "test_get_off_policy_mask_padding",
        *(f"test_warning_raised_sequence_level_with_token_summed_loss[{k}]"
          for k in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")),
        "test_no_reward_source_raises", "test_dataset_required_without_environment",
        "test_mismatched_reward_processing_classes_length", "test_correct_reward_processing_classes_list",
        "test_single_reward_model_with_single_processing_class",
        # tools and environments (TRL scripts the completions through a patched generate), the facade's
        # generation_kwargs, reward logging and attention paths: run with --max-steps 3 (SAMPLE_MAX_STEPS)
        "test_train_with_tools[tools0]", "test_train_with_malformed_tool_calls",
        "test_train_with_environment_factory", "test_train_with_multiple_environments",
        "test_environment_owned_reward_coexists_with_reward_funcs", "test_train_with_unknown_environment_raises",
        "test_train_with_generation_kwargs", "test_reward_metric_reflects_reward_weights[normalize_then_sum]",
        "test_train[trl-internal-testing/tiny-GptOssForCausalLM]",
        "test_train_with_cast_lm_head_to_fp32[trl-internal-testing/tiny-Gemma2ForCausalLM]")),
    # vision-language models: the multimodal RoPE, Gemma 4's per-layer inputs, Qwen3.5's linear attention
    *(f"TestGRPOTrainerVLM::test_train_vlm[trl-internal-testing/tiny-{m}]" for m in (
        "Qwen2_5_VLForConditionalGeneration", "Gemma4ForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration-NoThink")),
)
SAMPLE_MAX_STEPS = 3

# Tests of TRL's private implementation rather than its interface (issue 36's "short list"): when TRL passes them
# and the facade does not, they are listed with the reason in docs/trl_compat.md and not counted against it.
_LIGER_IMPORT = ("expects the ImportError of TRL's Liger path when liger-kernel is missing; the facade has no Liger "
                 "path (cohort's chunked logprob kernel replaces it, so use_liger_kernel is only announced)")
TRL_PRIVATE = {
    **{f"TestGRPORolloutDispatch::{t}": "calls TRL's private `_generate` with a `rollout_func` (cohort's engine "
       "generates; rollout_func is rejected)" for t in (
        "test_generate_prefers_rollout_func", "test_generate_rollout_func_syncs_vllm_weights_when_needed",
        "test_generate_rollout_func_raises_when_required_keys_are_missing")},
    "TestGRPOTrainer::test_prepare_input_called_with_correct_data": "counts the calls of TRL's private "
    "`training_step` and the batches they get",
    "TestGRPOTrainer::test_entropy_bonus_flows_gradients": "calls TRL's private `_get_per_token_logps_and_entropies`",
    "TestGRPOTrainer::test_liger_kernel_with_peft_non_lm_head_target_allowed": _LIGER_IMPORT,
    "TestGRPOTrainer::test_liger_kernel_with_peft_modules_to_save_lm_head_allowed": _LIGER_IMPORT,
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tests_dir(cache: Path = CACHE) -> Path:
    return cache / "trl-tests" / "tests"


def copy_trl_tests(source: Path, cache: Path = CACHE) -> Path:
    """TRL's test files from a checkout's tests/ folder (or the checkout itself) into the cache."""
    source = source / "tests" if (source / "tests" / TEST_FILE).is_file() else source
    missing = [f for f in TEST_SUPPORT if not (source / f).is_file()]
    if missing:
        raise SystemExit(f"{source}: no {', '.join(missing)}; pass TRL's tests/ folder (a checkout of "
                         "https://github.com/huggingface/trl) with --trl-tests or COHORT_TRL_TESTS.")
    target = tests_dir(cache)
    target.mkdir(parents=True, exist_ok=True)
    for name in TEST_SUPPORT:
        shutil.copyfile(source / name, target / name)
    (target.parent / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: TRL's slow tests\n")
    (target.parent / "source.json").write_text(json.dumps({"from": str(source), TEST_FILE: sha256(target / TEST_FILE)}))
    return target


def build_standins(cache: Path = CACHE, force: bool = False) -> dict:
    """The Hub stand-ins (models, tokenizer, zen datasets) in `cache`, built once per STANDINS_VERSION."""
    stamp = cache / "standins.json"
    if stamp.is_file() and not force:
        built = json.loads(stamp.read_text())
        if built.get("version") == STANDINS_VERSION:
            return built
    sys.path[:0] = [str(BENCH), str(ROOT)]
    import trl_suite_standins  # the harness's sibling (heavy imports: only when building)
    from tests.helpers.qwen3_tokenizer import qwen3_tokenizer_dir  # the tests' pinned Qwen3 tokenizer

    built = {"version": STANDINS_VERSION, **trl_suite_standins.build_all(cache, qwen3_tokenizer_dir())}
    stamp.write_text(json.dumps(built, indent=1))
    return built


def prepare(trl_tests: str | None, cache: Path = CACHE) -> Path:
    """TRL's tests in the cache (copied from `trl_tests` / COHORT_TRL_TESTS when given, else from the copy this
    repository keeps in third_party/trl) and the stand-ins."""
    source = trl_tests or os.environ.get("COHORT_TRL_TESTS") or (VENDORED if (VENDORED / TEST_FILE).is_file() else None)
    folder = copy_trl_tests(Path(source), cache) if source else tests_dir(cache)
    if not (folder / TEST_FILE).is_file():
        raise SystemExit(f"TRL's {TEST_FILE} is not in {folder}: run `python3 bench/trl_suite.py prepare "
                         "--trl-tests <a TRL checkout>/tests` first (see this script's docstring).")
    build_standins(cache)
    return folder


def run_mode(mode: str, folder: Path, out: Path, select: list[str] | None = None, keyword: str | None = None,
             cache: Path = CACHE, timeout_s: int = 300, max_steps: int | None = None) -> dict:
    """Run TRL's test file in `mode` ('trl' or 'facade'): {"tests": {id: result}, "imported": {...}, ...}."""
    out.mkdir(parents=True, exist_ok=True)
    junit, report = out / f"junit-{mode}.xml", out / f"plugin-{mode}.json"
    targets = [f"tests/{TEST_FILE}::{t}" for t in select] if select else [f"tests/{TEST_FILE}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_CACHE": str(cache / "hub"), "HF_HOME": str(cache / "hf_home"),
           "COHORT_TRL_SUITE_MODE": mode, "COHORT_TRL_SUITE_CACHE": str(cache), "COHORT_TRL_SUITE_REPORT": str(report),
           "COHORT_TRL_SUITE_TEST_TIMEOUT_S": str(timeout_s), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    if max_steps:
        env["COHORT_TRL_SUITE_MAX_STEPS"] = str(max_steps)
    cmd = [sys.executable, "-m", "pytest", *targets, "-p", "trl_suite_plugin", "-c", str(folder.parent / "pytest.ini"),
           "--rootdir", str(folder.parent), "-p", "no:cacheprovider", "-v", "-rN", f"--junitxml={junit}",
           *(["-k", keyword] if keyword else [])]
    (out / f"command-{mode}.txt").write_text(command_line())  # what `--reuse` records for this mode's results
    with open(out / f"pytest-{mode}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=folder.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
    if not junit.is_file():
        raise SystemExit(f"pytest wrote no {junit} (exit {proc.returncode}); see {out / f'pytest-{mode}.log'}")
    imported = json.loads(report.read_text()) if report.is_file() else {}
    return {"mode": mode, "exit": proc.returncode, "imported": imported.get("imported", {}), "max_steps": max_steps,
            "tests": parse_junit(junit)}


def reused(mode: str, work: Path) -> dict:
    """An earlier run's results of `mode` from its JUnit file and plugin report in `work`."""
    report, command = work / f"plugin-{mode}.json", work / f"command-{mode}.txt"
    imported = json.loads(report.read_text()).get("imported", {}) if report.is_file() else {}
    return {"mode": mode, "exit": None, "imported": imported, "tests": parse_junit(work / f"junit-{mode}.xml"),
            "command": command.read_text() if command.is_file() else None}


def parse_junit(path: Path) -> dict[str, dict]:
    """{test id ("Class::test[param]"): {"outcome": passed|failed|skipped|xfailed, "reason", "seconds"}}."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{cls}::{case.get('name')}" if cls and not cls.startswith("test_") else case.get("name", "")
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, reason = "failed", first_line(child.get("message") or child.text or child.tag)
            elif child.tag == "skipped":
                xfail = (child.get("type") or "") == "pytest.xfail"
                outcome, reason = ("xfailed" if xfail else "skipped"), first_line(child.get("message") or "")
        results[test_id] = {"outcome": outcome, "reason": reason, "seconds": round(float(case.get("time", 0)), 2)}
    return results


def first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else "")[:240]


def cause(reason: str) -> str:
    """A facade failure's cause for grouping: the exception and its message with values blanked out."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
    text = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", text)
    text = re.sub(r"\s+at 0x[0-9a-f]+", "", text)
    return text[:160]


def summarize(trl: dict, facade: dict | None) -> dict:
    """Counts per mode, the not-applicable tests and the facade's failures among those TRL passes."""
    counts = {mode["mode"]: _counts(mode["tests"]) for mode in (trl, facade) if mode}
    applicable = [t for t, r in trl["tests"].items() if r["outcome"] == "passed"]
    summary = {"counts": counts, "applicable": len(applicable),
               "not_applicable": {t: r["reason"] or r["outcome"] for t, r in trl["tests"].items()
                                  if r["outcome"] != "passed"}}
    if facade:
        fails = {t: facade["tests"].get(t, {"outcome": "not run", "reason": "not run"}) for t in applicable}
        failed = {t: r["reason"] or r["outcome"] for t, r in fails.items() if r["outcome"] != "passed"}
        private = {t: TRL_PRIVATE[t] for t in failed if t in TRL_PRIVATE}
        failed = {t: r for t, r in failed.items() if t not in private}
        groups: dict[str, list[str]] = {}
        for test, reason in failed.items():
            groups.setdefault(cause(reason), []).append(test)
        summary.update(facade_passed=len(applicable) - len(failed) - len(private), facade_failed=failed,
                       trl_private=private, facade_causes=dict(sorted(groups.items(), key=lambda kv: -len(kv[1]))))
    return summary


def _counts(tests: dict) -> dict:
    out = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    for r in tests.values():
        out[r["outcome"]] += 1
    return out


def markdown(summary: dict, trl: dict, facade: dict | None, source: dict, folder: str) -> str:
    """The docs section: counts per mode, then every test with both results, then failures by cause."""
    c = summary["counts"]
    lines = [DOCS_BEGIN, "", f"TRL's `tests/{TEST_FILE}` (SHA-256 `{source.get(TEST_FILE, '?')[:16]}…`) run offline by "
             "`bench/trl_suite.py` against trl as installed and against the facade (results: "
             f"`{folder}/results.json`). Not applicable: tests that do not pass with TRL itself here.",
             *([f"Run with `--max-steps {source['max_steps']}`: a test that trains for `num_train_epochs` trains "
                f"{source['max_steps']} optimiser steps instead, in both modes (the whole suite as written takes "
                "hours per mode on a shared 2-core CPU)."] if source.get("max_steps") else []), "",
             "| mode | passed | failed | skipped | xfailed |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {n['passed']} | {n['failed']} | {n['skipped']} | {n['xfailed']} |" for m, n in c.items()]
    private = summary.get("trl_private", {})
    lines += ["", f"Of the {summary['applicable']} tests that pass with TRL, the facade passes "
              f"**{summary.get('facade_passed', '—')}**; {len(private)} check TRL's private implementation (below); "
              f"{len(summary['not_applicable'])} are not applicable (they do not pass with TRL here).", ""]
    if private:
        lines += ["Tests of TRL's private implementation, not run as written by the facade:", ""]
        lines += [f"- `{t}`: {why}" for t, why in private.items()]
        lines.append("")
    if facade:
        lines += ["Facade failures by cause (the first line of the reason, values blanked):", ""]
        for reason, tests in summary["facade_causes"].items():
            lines.append(f"- **{len(tests)}** `{reason.replace('`', '')}`: " + ", ".join(f"`{t}`" for t in tests))
    lines += ["", "<details><summary>Every test</summary>", "", "| test | TRL | facade | facade's reason |",
              "|---|---|---|---|"]
    for test, r in trl["tests"].items():
        f = (facade or {}).get("tests", {}).get(test, {"outcome": "—", "reason": ""})
        why = f["reason"].replace("|", "\\|").replace("`", "") if f["outcome"] == "failed" else ""
        lines.append(f"| `{test}` | {r['outcome']} | {f['outcome']} | {why[:160]} |")
    lines += ["", "</details>", "", DOCS_END]
    return "\n".join(lines)


def write_docs(section: str, path: Path = DOCS) -> None:
    """Replace the generated section of docs/trl_compat.md (added under "TRL's own test suite" if absent)."""
    text = path.read_text()
    if DOCS_BEGIN in text:
        head, rest = text.split(DOCS_BEGIN, 1)
        text = head + section + rest.split(DOCS_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## TRL's own test suite\n\n" + section + "\n"
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="copy TRL's tests into the cache and build the stand-ins")
    prep.add_argument("--trl-tests", help="TRL's tests/ folder (default: COHORT_TRL_TESTS)")
    prep.add_argument("--rebuild", action="store_true", help="build the stand-ins again")
    run = sub.add_parser("run", help="run TRL's test file against TRL and/or the facade")
    run.add_argument("--trl-tests", help="as for prepare (default: the copy in the cache)")
    run.add_argument("--mode", choices=("both", "trl", "facade"), default="both")
    run.add_argument("--sample", action="store_true", help="only the CI sample (SAMPLE)")
    run.add_argument("-k", dest="keyword", help="pytest -k expression")
    run.add_argument("--test", action="append", help="a test id (Class::test[param]); repeatable")
    run.add_argument("--timeout-s", type=int, default=300, help="per test")
    run.add_argument("--max-steps", type=int, help="train N optimiser steps where a test would train for "
                     "num_train_epochs (both modes alike; recorded in the results and the docs)")
    run.add_argument("--no-write", action="store_true", help="print the summary only (no results, no docs)")
    run.add_argument("--work", help="folder for the JUnit files and logs (default: a new temporary folder)")
    run.add_argument("--reuse", action="append", choices=("trl", "facade"), default=[],
                     help="take this mode's results from --work's JUnit file of an earlier run instead of running it")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        if args.rebuild:
            build_standins(force=True)
        print(f"TRL's tests in {prepare(args.trl_tests)}; stand-ins in {CACHE}")
        return 0
    folder = prepare(args.trl_tests)
    select = list(SAMPLE) if args.sample else args.test
    if args.sample and args.max_steps is None:
        args.max_steps = SAMPLE_MAX_STEPS
    return _run(args, folder, select)


def _run(args, folder: Path, select: list[str] | None) -> int:
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="trl-suite-"))
    modes = ("trl", "facade") if args.mode == "both" else (args.mode,)
    runs = {m: reused(m, work) if m in args.reuse else
            run_mode(m, folder, work, select, args.keyword, timeout_s=args.timeout_s, max_steps=args.max_steps)
            for m in modes}
    trl, facade = runs.get("trl"), runs.get("facade")
    summary = summarize(trl or facade, facade if trl else None)
    print(json.dumps({k: v for k, v in summary.items() if k != "not_applicable"}, indent=1))
    if args.no_write or trl is None:
        print(f"logs and JUnit files in {work}")
        return 0
    source = json.loads((folder.parent / "source.json").read_text()) if (folder.parent / "source.json").is_file() else {}
    out = new_run_folder("trl-suite")
    rel = out.relative_to(ROOT).as_posix()
    (out / "results.json").write_text(json.dumps({"source": source, "max_steps": args.max_steps, "summary": summary,
                                                  "runs": runs}, indent=1))
    commands = [r.get("command") for r in runs.values() if r.get("command")]  # the runs reused from --work
    write_manifest(out, "TRL's tests/test_grpo_trainer.py against trl and the cohort facade, offline stand-ins",
                   "\n".join([*commands, command_line()]), folder_names(out),
                   docs_section="docs/trl_compat.md: TRL's own test suite")
    write_docs(markdown(summary, trl, facade, {**source, "max_steps": args.max_steps}, rel))
    print(f"results: {rel}/results.json; docs/trl_compat.md updated")
    return 0


def folder_names(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.is_file() and p.name != "manifest.json")


if __name__ == "__main__":
    sys.exit(main())

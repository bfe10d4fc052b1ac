"""Every bad input gets a clear message naming the field, the value and the fix, exit status 2, and no
half-written run directory."""

from __future__ import annotations

import json

import pytest
from tests.helpers.toy_task import write_toy_workspace

from cohort.cli import main


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_toy_workspace(tmp_path_factory.mktemp("ws"))


def run_cli(capsys, workspace, tmp_path, *overrides: str, data=None) -> tuple[int, str, object]:
    model_dir, toy = workspace
    out = tmp_path / "run"
    args = ["train", f"model.name_or_path={model_dir}", f"data.source={data or toy}",
            "reward.funcs=[tests.helpers.toy_task:digit_share]", "train.max_steps=2", "train.prompts_per_step=2",
            "generation.num_generations=2", "generation.max_completion_length=4", f"run.output_dir={out}",
            "run.report_to=[jsonl]", *overrides]
    code = main(args)
    return code, capsys.readouterr().err, out


CASES = {
    "unknown key": (["train.max_stpes=3"], ["train.max_stpes", "Did you mean 'max_steps'"]),
    "unknown loss parameter": (["loss.epsilonn=0.3"], ["epsilonn", "epsilon"]),
    "one generation": (["generation.num_generations=1"], ["generation.num_generations=1", "2 or more"]),
    "mini-batches": (["train.prompts_per_step=3", "train.mini_batches=2"],
                     ["train.mini_batches=2", "divide train.prompts_per_step=3"]),
    "missing model": (["model.name_or_path=/no/such/model"], ["/no/such/model"]),
    "reward wrong length": (["reward.funcs=[tests.helpers.toy_task:wrong_length]"],
                            ["wrong_length", "values"]),
    "reward raises": (["reward.funcs=[tests.helpers.toy_task:raises]"],
                      ["raises", "reward backend unavailable"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_cleanly(name, capsys, workspace, tmp_path):
    overrides, expected = CASES[name]
    code, err, out = run_cli(capsys, workspace, tmp_path, *overrides)
    assert code == 2, err
    assert "cohort: error:" in err, err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert "Traceback" not in err
    assert not out.exists(), f"{name}: left a run directory behind"


def test_missing_prompt_column(capsys, workspace, tmp_path):
    bad = tmp_path / "noprompt.jsonl"
    bad.write_text(json.dumps({"question": "hi", "digit": "1"}) + "\n")
    code, err, out = run_cli(capsys, workspace, tmp_path, data=bad)
    assert code == 2
    assert "prompt" in err and "question" in err, err
    assert not out.exists()


def test_good_input_runs(capsys, workspace, tmp_path):
    code, err, out = run_cli(capsys, workspace, tmp_path)
    assert code == 0, err
    assert (out / "metrics.jsonl").is_file() and (out / "config.yaml").is_file()


def test_generate_eval_and_plot_commands(capsys, workspace, tmp_path):
    model_dir, toy = workspace
    assert main(["generate", str(model_dir), "Say the digit 3", "-n", "2", "--max-tokens", "4",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- [") == 2
    eval_args = ["eval", f"model.name_or_path={model_dir}", f"data.source={toy}", "data.eval_size=10",
                 "reward.funcs=[tests.helpers.toy_task:digit_share]", "generation.max_completion_length=4"]
    samples = tmp_path / "answers.jsonl"
    assert main([*eval_args, "--samples", str(samples)]) == 0
    out = capsys.readouterr().out
    assert "accuracy:" in out
    assert "eval: 10/10 prompts x 1 (100%)" in out  # progress, one line per batch of prompts
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(rows) == 10 and {"prompt", "completion", "reward", "correct"} <= set(rows[0])
    assert main([*eval_args, "--samples", str(tmp_path / "no" / "such" / "a.jsonl")]) == 2
    assert "--samples=" in capsys.readouterr().err
    code, err, run = run_cli(capsys, workspace, tmp_path)
    assert code == 0, err
    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 0


def test_resume_flag_continues_a_recipe_that_overwrites(capsys, workspace, tmp_path):
    code, err, run = run_cli(capsys, workspace, tmp_path, "run.overwrite=true")
    assert code == 0, err
    code, err, _ = run_cli(capsys, workspace, tmp_path, "run.overwrite=true", "train.max_steps=3", "--resume")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]

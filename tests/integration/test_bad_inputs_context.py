"""Lengths over what the model or the device allows stop before any weight loads (issue 33), through the CLI as a
person would type them: `generation.max_completion_length` against the GPU's memory (the update's estimate, one
sequence's KV cache) with the device's size stood in for on the CPU, and the context `cohort serve` and the engine
choose by default (the model's own, within what one sequence can have in the KV pool). The context cases a CPU
shows as they are run in the bad-input matrix (tests/integration/test_bad_inputs.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tests.helpers.toy_task import write_toy_workspace

    root = tmp_path_factory.mktemp("lengths")
    model_dir, toy = write_toy_workspace(root)
    return {"root": root, "model": model_dir, "toy": toy}


def _train(workspace, tmp_path, monkeypatch, capsys, device_bytes: int, *overrides: str):
    """`cohort train` on the toy workspace as if the device held `device_bytes` (the check runs on a GPU only);
    returns (exit code, stderr, whether the model loaded)."""
    from cohort.cli import main
    from cohort.setup import length_checks
    from cohort.setup import policy as setup_policy

    loads = []
    real_load = setup_policy.load_policy
    monkeypatch.setattr(setup_policy, "load_policy", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    monkeypatch.setattr(length_checks, "_device_bytes", lambda device: device_bytes)
    argv = ["train", f"model.name_or_path={workspace['model']}", f"data.source={workspace['toy']}",
            "reward.funcs=[tests.helpers.toy_task:digit_share]", "train.max_steps=1", "train.prompts_per_step=2",
            "generation.num_generations=2", f"run.output_dir={tmp_path / 'run'}", "run.report_to=[jsonl]",
            "data.max_prompt_length=32", *overrides]
    code = main(argv)
    return code, capsys.readouterr().err, bool(loads)


def test_a_completion_over_what_memory_allows_stops_before_the_model_loads(workspace, tmp_path, monkeypatch, capsys):
    # 10 MiB: the tiny model's update fits at ~130 completion tokens, not at 200 (the estimate grows with the
    # micro-batch a 232-token sequence makes)
    code, err, loaded = _train(workspace, tmp_path, monkeypatch, capsys, 10 << 20, "generation.max_completion_length=200")
    assert code == 2 and not loaded, err
    line = err[err.index("cohort: error:"):]
    assert "generation.max_completion_length=200 does not fit the device's memory" in line, line
    best = int(line.split("the largest that fits is ")[1].split()[0])
    assert 1 <= best < 200
    assert not (tmp_path / "run").exists()
    # the value it names is one the check lets through (it fails later only for want of a real GPU)
    from cohort.config import load_config
    from cohort.policy.context import peek_config
    from cohort.setup import length_checks

    cfg = load_config(None, [f"model.name_or_path={workspace['model']}", "data.max_prompt_length=32",
                             "train.prompts_per_step=2", "generation.num_generations=2",
                             f"generation.max_completion_length={best}"])
    length_checks._check_memory(cfg, peek_config(str(workspace["model"])), torch.device("cpu"), torch.float32,
                                10 << 20, 256)
    cfg.generation.max_completion_length = best + 1
    with pytest.raises(Exception, match=f"max_completion_length={best + 1}"):
        length_checks._check_memory(cfg, peek_config(str(workspace["model"])), torch.device("cpu"), torch.float32,
                                    10 << 20, 256)


def test_a_sequence_over_the_kv_cache_names_the_fraction_and_the_largest_that_fits(workspace, tmp_path,
                                                                                    monkeypatch, capsys):
    # 1 GiB holds the update easily; 1e-4 of it (~107 KB) holds 208 tokens of the tiny model's KV (512 B each)
    code, err, loaded = _train(workspace, tmp_path, monkeypatch, capsys, 1 << 30,
                               "generation.max_completion_length=200", "generation.kv_cache_fraction=0.0001")
    assert code == 2 and not loaded, err
    line = err[err.index("cohort: error:"):]
    for fragment in ("generation.max_completion_length=200", "one sequence of 32 + 200 tokens", "KV cache",
                     "generation.kv_cache_fraction=0.0001", "the largest that fits is 176"):
        assert fragment in line, (fragment, line)


def test_a_length_that_fits_goes_on_to_load_the_model(workspace, tmp_path, monkeypatch, capsys):
    """The check refuses only what does not fit: with room, the run loads its model and trains."""
    code, err, loaded = _train(workspace, tmp_path, monkeypatch, capsys, 1 << 30, "generation.max_completion_length=8")
    assert code == 0 and loaded, err


def test_the_engine_takes_the_models_context_within_what_one_sequence_can_have(workspace):
    """CohortEngine's default context is the model's (256 for the tiny model), not a fixed 4,096, lowered to
    what one sequence can have in the KV pool when the pool is smaller; the note `cohort serve` prints says why."""
    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import tiny_model

    from cohort.engine import CohortEngine
    from cohort.serving.server import _context_line

    tok = make_tiny_tokenizer()
    model = tiny_model(tok)
    model.config.max_position_embeddings = 8192  # above the old fixed 4,096
    roomy = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id])
    assert roomy.config.max_model_len == 8192
    assert _context_line(roomy) == roomy.context_note
    assert "the model's max_position_embeddings" in roomy.context_note
    tight = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], kv_cache_fraction=1e-5)  # 5 blocks of 16
    assert tight.config.max_model_len == 80 and tight.runner.num_blocks == 5
    assert "what one sequence can have in the KV pool" in tight.context_note and "8192" in tight.context_note
    asked = CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], max_model_len=64)
    assert asked.config.max_model_len == 64 and "given" in asked.context_note
    with pytest.raises(RuntimeError, match="fewer than one sequence"):  # asked for: too big is still an error
        CohortEngine(model, tok, eos_token_ids=[tok.eos_token_id], max_model_len=4096, kv_cache_fraction=1e-5)

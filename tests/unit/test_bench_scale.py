"""bench/scale.py: the CPU smoke mode launches one torchrun per row (1 and 2 gloo ranks) and prints a table
with both rows; the row plan, the per-GPU rates, error extraction, the launch timeout and the TRL row's
accelerate config."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "scale.py"


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("scale_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_two_rows(tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, str(BENCH), "--gpus", "1,2", "--shardings", "none", "--big-gpus", "0", "--no-trl",
           "--sizes", "tiny", "--device", "cpu", "--prompts", "2", "--generations", "2", "--prompt-len", "8",
           "--completion-len", "8", "--warmup", "1", "--steps", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.startswith("| model | trainer | GPUs | sharding | s/step") for ln in lines)
    rows = [ln for ln in lines if ln.startswith("| tiny | cohort |")]
    assert len(rows) == 2 and rows[0].startswith("| tiny | cohort | 1 | none | ")
    assert rows[1].startswith("| tiny | cohort | 2 | none | ") and "failed" not in proc.stdout
    assert rows[0].split("|")[10].strip() == "100%"  # the 1-GPU row is its own scaling baseline
    results = json.loads(out.read_text())["results"]
    assert [r["status"] for r in results] == ["ok", "ok"]
    for r, gpus in zip(results, (1, 2)):
        # per GPU 2 prompts x 2 completions of 8 + 8 tokens; every rank reported
        assert [s["tokens"] for s in r["steps"]] == [64 * gpus] * 2
        assert r["summary"]["ranks_reported"] == gpus and len(r["history"]) == 2
        assert r["history"][-1]["completions/mean_length"] == 8.0


def _args(scale, *argv):
    return scale.parse_args(["--device", "cuda", *argv])


def test_plan_orders_rows_by_importance(scale):
    names = [scale.row_name(r) for r in scale.plan_rows(_args(scale))]
    assert names == ["1.5b cohort none x1", "1.5b cohort fsdp x1", "1.5b cohort none x4", "1.5b cohort fsdp x4",
                     "7b cohort fsdp x4", "1.5b trl fsdp2 (accelerate) x4", "1.5b cohort none x2",
                     "1.5b cohort fsdp x2"]
    names = [scale.row_name(r) for r in scale.plan_rows(_args(scale, "--gpus", "2", "--big-gpus", "0", "--no-trl"))]
    assert names == ["1.5b cohort none x2", "1.5b cohort fsdp x2"]


def test_cpu_defaults_leave_out_the_big_row(scale):
    args = scale.parse_args(["--device", "cpu"])
    assert args.big_gpus == 0 and args.big_size == "tiny"


def test_row_commands(scale, tmp_path):
    args = _args(scale, "--token-budget", "4096")
    rows = scale.plan_rows(args)
    fsdp4 = scale.row_command(args, rows[3], str(tmp_path))
    assert fsdp4[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(BENCH)]
    assert fsdp4[fsdp4.index("--sharding") + 1] == "fsdp" and fsdp4[fsdp4.index("--token-budget") + 1] == "4096"
    assert fsdp4[fsdp4.index("--prompts") + 1] == "32" and "--big" not in fsdp4  # prompts per GPU
    big = scale.row_command(args, rows[4], str(tmp_path))
    assert "--big" in big and big[big.index("--token-budget") + 1] == "16384" and big[big.index("--size") + 1] == "7b"
    assert big[big.index("--override") + 1] == "model.gradient_checkpointing=true"
    assert fsdp4.count("--override") == 2  # the 1.5B fsdp rows' default knobs
    trl = scale.row_command(args, rows[5], str(tmp_path))
    assert trl[1:3] == ["-m", "accelerate.commands.launch"] and trl[trl.index("--num_processes") + 1] == "4"
    config = json.loads(Path(trl[trl.index("--config_file") + 1]).read_text())
    assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    assert config["mixed_precision"] == "bf16" and config["num_processes"] == 4
    assert trl[trl.index("--micro-batch") + 1] == "32"


def test_summary_per_gpu_rates(scale):
    history = [{"step_time": 9.0, "time/generate": 5.0, "time/update": 3.0, "time/weight_gather": 0.5,
                "time/sync_weights": 0.6, "num_tokens": 1000},
               {"step_time": 4.0, "time/generate": 1.0, "time/update": 2.0, "time/weight_gather": 0.25,
                "time/sync_weights": 0.3, "num_tokens": 2000}]
    steps = scale.steps_of({"history": history}, {}, None)
    assert [s["tokens"] for s in steps] == [1000, 1000] and steps[1]["weight_gather"] == 0.25
    spec = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1024}
    s = scale.summarise(steps, num_params=10**6, gpus=2, warmup=1, spec=spec, tied=True, prompt_len=40,
                        completion_len=60)
    assert s["step"] == 4.0 and s["measured_steps"] == 1
    assert s["tok_s_per_gpu"] == pytest.approx(1000 / 4.0 / 2)
    # 1,000 tokens = 10 sequences of 40 + 60; decoder 10**6 - 65,536 weights, LM head 65,536 on 60 tokens,
    # attention 6 x 2 layers x 64 x 100 x 101
    per_seq = 6 * (10**6 - 65_536) * 100 + 6 * 65_536 * 60 + 6 * 2 * 64 * 100 * 101
    assert s["mfu"] == pytest.approx(10 * per_seq / 2 / 2.0 / 989e12)
    lora = scale.summarise(steps, num_params=10**6, gpus=2, warmup=1, spec=spec, tied=True, prompt_len=40,
                           completion_len=60, weight_grads=False)
    per_seq = 4 * (10**6 - 65_536) * 100 + 4 * 65_536 * 60 + 6 * 2 * 64 * 100 * 101
    assert lora["mfu"] == pytest.approx(10 * per_seq / 2 / 2.0 / 989e12)
    # no weight gather metric (data parallel): the engine's sync_weights is shown instead
    del history[1]["time/weight_gather"]
    assert scale.steps_of({"history": history}, {}, None)[1]["weight_gather"] == 0.3


def test_table_efficiency_and_failed_rows(scale):
    def row(gpus, tok, **extra):
        return {"kind": "cohort", "trainer": "cohort", "size": "1.5b", "gpus": gpus, "sharding": "fsdp",
                "summary": {"step": 1.0, "generate": 0.4, "update": 0.5, "weight_gather": 0.05,
                            "tok_s_per_gpu": tok, "mfu": 0.4, "peak_alloc_gib": 30.0}, **extra}
    failed = {"kind": "trl", "trainer": "trl", "size": "1.5b", "gpus": 4, "sharding": "fsdp2 (accelerate)",
              "error": "torch.OutOfMemoryError: CUDA out of memory | x"}
    lines = scale.table([row(4, 9000.0), row(1, 10000.0), failed]).splitlines()
    assert lines[2].startswith("| 1.5B | cohort | 1 | fsdp | 1.00 | 0.40 | 0.50 | 0.050 | 10.0k | 100% | 40.0% |")
    assert "| 4 | fsdp |" in lines[3] and "| 90% |" in lines[3]
    assert lines[4].startswith("| 1.5B | TRL GRPOTrainer | 4 | fsdp2 (accelerate) | failed: torch.OutOfMemoryError")
    assert lines[4].count("|") == lines[2].count("|")


def test_error_line_skips_torchrun_summary(scale):
    log = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
           "E1126 torch.distributed.elastic.multiprocessing.api: failed\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n============\n")
    assert scale.error_line(log).startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert scale.error_line("just a line\n") == "just a line"


def test_launch_timeout_kills_the_group(scale, tmp_path):
    status, wall = scale.launch([sys.executable, "-c", "import time; time.sleep(30)"], 1.0,
                                str(tmp_path / "log.txt"))
    assert status == "timeout after 1 s" and wall < 20


def test_big_model_is_untied_on_cpu(scale):
    import torch

    model = scale.build_big("tiny", torch.device("cpu"))
    assert not model.config.tie_word_embeddings and next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()


def test_trl_steps_from_logs():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from scale_trl import _steps
    finally:
        sys.path.remove(str(ROOT / "bench"))
    args = argparse.Namespace(prompts=2, generations=4, prompt_len=10, completion_len=20)
    raw = [{"step": 5.0, "generate": 2.0, "prepare": 3.0}, {"step": 4.0, "generate": 1.5, "prepare": 2.5}]
    logs = [{"num_tokens": 480.0, "completions/mean_length": 20.0}, {"num_tokens": 960.0}]
    steps = _steps(args, raw, logs, world=2)
    assert [s["tokens"] for s in steps] == [480.0, 480.0] and steps[0]["workload_tokens"] == 480
    assert steps[1]["update"] == pytest.approx(1.5) and steps[0]["weight_gather"] is None


def test_baseline_from_an_earlier_run(scale, tmp_path):
    def row(gpus, tok):
        return {"kind": "cohort", "trainer": "cohort", "size": "1.5b", "gpus": gpus, "sharding": "none",
                "summary": {"step": 1.0, "generate": 0.4, "update": 0.5, "weight_gather": 0.0,
                            "tok_s_per_gpu": tok, "mfu": 0.4, "peak_alloc_gib": 30.0}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"results": [row(1, 10000.0), row(4, 9000.0)]}))
    text = scale.table([row(2, 9500.0)], scale.load_previous(str(earlier)))
    assert "| 95%* |" in text and "--baseline-from" in text.splitlines()[-1]
    assert "*" not in scale.table([row(1, 10000.0), row(2, 9500.0)], scale.load_previous(str(earlier)))

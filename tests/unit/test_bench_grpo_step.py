"""bench/grpo_step.py on the CPU: the workload is what it claims (exact prompt and completion lengths), the
derived numbers are right, `generation.ignore_eos` reaches the sampling parameters, and the cohort rows run
without reasoning-gym (the GPU machines have none: the bench feeds its own prompts)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from cohort.config import CohortConfig, apply_overrides
from cohort.errors import ConfigError
from cohort.setup import sampling_params_for

BENCH = Path(__file__).resolve().parents[2] / "bench" / "grpo_step.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("grpo_step_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ignore_eos_reaches_sampling_params():
    cfg = CohortConfig()
    assert sampling_params_for(cfg, None, n=2, seed=None).ignore_eos is False
    apply_overrides(cfg, ["generation.ignore_eos=true"])
    params = sampling_params_for(cfg, None, n=2, seed=None)
    assert params.ignore_eos is True and params.n == 2


def test_prompts_encode_to_exact_length_and_every_id_decodes(bench):
    tok = bench.build_tokenizer(1024)
    prompts = bench.make_prompts(6, 37, 1024, seed=3)
    ids = [tok(p)["input_ids"] for p in prompts]
    assert [len(i) for i in ids] == [37] * 6
    assert all(bench.eos_id(1024) not in row and max(row) < 1024 for row in ids)
    assert tok.eos_token_id == 1023 and bench.eos_id(151936) == 151643
    assert tok.decode([0, 5, 1022]) == "w0 w5 w1022"


def test_summary_rates(bench):
    args = argparse.Namespace(warmup=1, prompts=2, generations=4, prompt_len=10, completion_len=20)
    step = {"step": 2.0, "generate": 1.0, "score": 0.1, "logprobs": 0.0, "update": 0.5, "other": 0.4}
    result = {"steps": [{**step, "step": 99.0}, step, step], "num_params": 100_000}
    s = bench.summarise(args, result, "tiny")
    assert s["step"] == 2.0 and s["measured_steps"] == 2  # the warmup step is left out
    assert s["gen_tok_s"] == pytest.approx(8 * 20 / 2.0)
    # tiny: LM head 1024 x 64 = 65,536 weights (tied), so 34,464 decoder weights; 4 heads of 16, 2 layers.
    # Per sequence of 10 + 20 tokens: decoder 6 x 34,464 x 30 = 6,203,520, LM head on the 20 completion
    # tokens 6 x 65,536 x 20 = 7,864,320, causal attention 6 x 2 x 64 x 30 x 31 = 714,240: 14,782,080.
    assert s["mfu"] == pytest.approx(8 * 14_782_080 / 0.5 / 989e12)
    assert s["mfu_6n"] == pytest.approx(6 * 100_000 * 8 * 30 / 0.5 / 989e12)


@pytest.fixture
def no_reasoning_gym(monkeypatch):
    """`import reasoning_gym` (and its submodules) fails, as on a machine without the package."""
    for name in [n for n in sys.modules if n == "reasoning_gym" or n.startswith("reasoning_gym.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # None in sys.modules: ImportError on import


def test_reasoning_gym_source_still_needs_the_package(no_reasoning_gym):
    """The block works, and a config that really names a reasoning-gym source keeps its clear error."""
    with pytest.raises(ImportError):
        import reasoning_gym  # noqa: F401
    with pytest.raises(ConfigError, match=r"data.source='reasoning_gym:chain_sum' needs reasoning-gym"):
        CohortConfig().validate()


@pytest.mark.parametrize("runner", ["cohort", "cohort-lowmem"])
def test_cohort_child_runs_exact_lengths_on_cpu(bench, runner, no_reasoning_gym):
    args = argparse.Namespace(size="tiny", device="cpu", warmup=1, steps=1, prompts=2, generations=2,
                              prompt_len=8, completion_len=12, token_budget=None, mem_cap=None,
                              compile_layers=False, lowmem_token_budget=64, lowmem_chunk_tokens=8,
                              lowmem_release_kv=True, chunk_tokens=None, profile_update=False, profile_generate=False,
                              lowmem_offload=True)
    result = bench.run_cohort(args, lowmem=runner == "cohort-lowmem")
    assert len(result["steps"]) == 2
    assert all(s["completion_len"] == 12.0 for s in result["steps"])  # ignore_eos: never shorter
    assert all(s["update"] > 0 and s["generate"] > 0 for s in result["steps"])
    assert result["gradient_checkpointing"] is (runner == "cohort-lowmem")
    # fp32 CPU weights: plain AdamW, or the host-offloaded one in the low-memory setting
    assert result["optimizer"] == ("HostOffloadAdamW" if runner == "cohort-lowmem" else "AdamW")
    assert result["release_kv_during_update"] is (runner == "cohort-lowmem")
    assert result["logprob_chunk_tokens"] == (8 if runner == "cohort-lowmem" else 4096)
    assert result["keep_logits"] is (runner == "cohort")
    import cohort.trainer
    # the bench's patches are scoped to the run
    assert cohort.trainer._save.__name__ == "_save"
    assert cohort.trainer.PolicyUpdater.update.__name__ == "update"


# ---------------------------------------------------------------------------------------------------------
# The two TRL rows (issue 16): TRL defaults and TRL tuned, and the ratio against the faster one


@pytest.fixture(scope="module")
def bench_trl():
    import sys

    sys.path.insert(0, str(BENCH.parent))  # grpo_step_trl imports grpo_step from its own folder
    try:
        import grpo_step_trl
    finally:
        sys.path.remove(str(BENCH.parent))
    return grpo_step_trl


def test_trl_batch_shape_holds_exactly_the_step(bench_trl):
    assert bench_trl.trl_batch_shape(256, 8) == (8, 32)  # TRL defaults on the bench workload
    assert bench_trl.trl_batch_shape(256, 32) == (32, 8)  # TRL tuned
    assert bench_trl.trl_batch_shape(16, 32) == (16, 1)  # CPU smoke size: fewer completions than a micro-batch
    with pytest.raises(ValueError, match=r"40 completions.*micro-batches of 32.*train on 32"):
        bench_trl.trl_batch_shape(40, 32)
    with pytest.raises(ValueError, match="must be >= 1"):
        bench_trl.trl_batch_shape(256, 0)


def test_trl_settings_defaults_vs_tuned(bench_trl):
    # the defaults row passes only the batch shape: checkpointing, cache and backend stay TRL's own
    assert bench_trl.trl_settings(False, 256) == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 32}
    assert bench_trl.trl_settings(True, 256) == {
        "per_device_train_batch_size": 32, "gradient_accumulation_steps": 8, "gradient_checkpointing": False,
        "cache_implementation": None, "use_transformers_continuous_batching": False}
    assert bench_trl.trl_settings(True, 256, tuned_micro=16)["gradient_accumulation_steps"] == 16


@pytest.mark.parametrize("tuned", [False, True])
def test_trl_settings_make_one_generation_batch_per_step(bench_trl, tuned, tmp_path):
    """In TRL 1.16's GRPOConfig both rows generate the whole step (256 completions) at once, and only the
    tuned row turns gradient checkpointing off."""
    trl = pytest.importorskip("trl", reason="needs TRL: pip install trl==1.16.0")
    cfg = trl.GRPOConfig(output_dir=str(tmp_path), num_generations=8, use_cpu=True, report_to="none",
                         **bench_trl.trl_settings(tuned, 256))
    assert cfg.generation_batch_size == 256
    assert cfg.steps_per_generation == cfg.gradient_accumulation_steps == (8 if tuned else 32)
    assert cfg.gradient_checkpointing is (not tuned)
    assert cfg.cache_implementation is None and cfg.use_transformers_continuous_batching is False


def _res(step: float, peak: float = float("nan")) -> dict:
    summary = {"step": step, "generate": 0.5, "score": 0.0, "logprobs": 0.0, "update": 0.25, "other": 0.0,
               "gen_tok_s": 1000.0, "mfu": 0.1}
    return {"summary": summary, "peak_alloc_gib": peak, "peak_reserved_gib": peak}


def test_table_speedup_against_faster_trl_and_memory_bar_of_trl_defaults(bench):
    results = {"0.5b": {"trl": _res(10.0, 5.0), "trl-tuned": _res(6.0, 40.0), "cohort": _res(1.5, 38.0),
                        "cohort-lowmem": _res(2.0, 6.0)}}
    name, best = bench.fastest_trl(results["0.5b"])
    assert name == "trl-tuned" and best["summary"]["step"] == 6.0
    lines = bench.table(results).splitlines()
    head, rows = lines[0], {line.split(" | ")[1]: line for line in lines[2:6]}
    assert head.endswith("| vs TRL defaults | vs faster TRL |")
    assert rows["cohort"].endswith("| 6.67x | 4.00x (trl-tuned) |")  # 10 / 1.5 and 6 / 1.5
    assert rows["trl"].endswith("| 1.00x | 0.60x (trl-tuned) |")
    # the low-memory bar is the TRL defaults' peak (5.0), not the tuned row's (40.0)
    assert "6.00 (over TRL defaults' peak)" in rows["cohort-lowmem"]
    assert rows["cohort-lowmem"].endswith("| 5.00x | 3.00x (trl-tuned) |")
    assert lines[-1] == "vs faster TRL (the ratio that counts): 0.5b: faster TRL row is trl-tuned (6.00 s/step)"
    # every row has the header's number of cells, a failed one too
    results["1.5b"] = {"trl": _res(9.0, 13.0), "trl-tuned": {"error": "CUDA out of memory"},
                       "cohort-lowmem": _res(3.0, 9.0)}
    lines = bench.table(results).splitlines()
    assert {line.count("|") for line in lines[:9]} == {head.count("|")} and lines[9] == ""
    rows15 = {line.split(" | ")[1]: line for line in lines[6:9]}
    assert rows15["trl-tuned"].startswith("| 1.5b | trl-tuned | failed: CUDA out of memory |")
    assert rows15["cohort-lowmem"].endswith("| 3.00x | 3.00x (trl) |")  # only TRL defaults ran
    assert "9.00 (within TRL defaults' peak)" in rows15["cohort-lowmem"]
    assert lines[-1].endswith("; 1.5b: faster TRL row is trl (9.00 s/step)")
    assert bench.fastest_trl({"cohort": _res(1.0)}) is None
    assert bench.table({"x": {"cohort": _res(1.0)}}).splitlines()[2].endswith("| n/a | n/a |")


def test_runner_order_puts_trl_defaults_first_and_rejects_unknown(bench):
    assert bench.runner_order("cohort-lowmem, trl-tuned,trl") == ["trl", "trl-tuned", "cohort-lowmem"]
    assert bench.runner_order(",".join(bench.RUNNERS)) == list(bench.RUNNERS)
    with pytest.raises(ValueError, match=r"unknown or no runner.*'trl_tuned'"):
        bench.runner_order("trl,trl_tuned")
    with pytest.raises(SystemExit):  # argparse error before any child starts
        bench.main(["--runners", "bogus"])


def test_trl_tuned_child_runs_exact_lengths_on_cpu(bench_trl):
    """The tuned TRL row end to end on the tiny size: one micro-batch holds the step, no checkpointing."""
    pytest.importorskip("trl", reason="needs TRL: pip install trl==1.16.0")
    pytest.importorskip("datasets", reason="needs datasets: pip install datasets")
    args = argparse.Namespace(size="tiny", device="cpu", warmup=1, steps=1, prompts=2, generations=2,
                              prompt_len=8, completion_len=12, trl_tuned_micro=32)
    result = bench_trl.run_trl(args, tuned=True)
    assert len(result["steps"]) == 2
    assert all(s["completion_len"] == 12.0 for s in result["steps"])  # min_new_tokens: never shorter
    assert all(s["update"] > 0 and s["generate"] > 0 for s in result["steps"])
    assert (result["micro_batch"], result["gradient_accumulation_steps"], result["steps_per_generation"]) == (4, 1, 1)
    assert result["gradient_checkpointing"] is False and result["continuous_batching"] is False
    assert result["cache_implementation"] is None and result["model_gradient_checkpointing"] is False


def test_cohort_child_profiles_last_generate_and_update_on_cpu(bench, no_reasoning_gym, capsys, monkeypatch):
    """--profile-update / --profile-generate: one extra step, profiled, printed, and left out of the means."""
    monkeypatch.syspath_prepend(str(Path(bench.__file__).parent))  # trace_gaps sits beside the script
    args = argparse.Namespace(size="tiny", device="cpu", warmup=1, steps=1, prompts=2, generations=2,
                              prompt_len=8, completion_len=12, token_budget=None, mem_cap=None,
                              compile_layers=False, lowmem_token_budget=64, lowmem_chunk_tokens=8,
                              lowmem_release_kv=True, chunk_tokens=None, profile_update=True, profile_generate=True,
                              lowmem_offload=True)
    result = bench.run_cohort(args, lowmem=False)
    assert len(result["steps"]) == 3 and result["profiled_last"]
    out = capsys.readouterr().out
    assert out.count("PROFILE-BEGIN generate") == 1 and out.count("PROFILE-BEGIN update") == 1
    assert "generate timeline" in out and "update timeline" in out
    # the update's host preparation, timed call by call, and the garbage collector's passes
    assert "the update's host-side preparation: _micro_batches at +" in out
    assert "_host_tensors at +" in out and "Python's garbage collector in the update: gen 0:" in out

"""bench/grpo_step.py on the CPU: the workload is what it claims (exact prompt and completion lengths), the
derived numbers are right, and `generation.ignore_eos` reaches the sampling parameters."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from cohort.config import CohortConfig, apply_overrides
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
    result = {"steps": [{**step, "step": 99.0}, step, step], "num_params": 1000}
    s = bench.summarise(args, result)
    assert s["step"] == 2.0 and s["measured_steps"] == 2  # the warmup step is left out
    assert s["gen_tok_s"] == pytest.approx(8 * 20 / 2.0)
    assert s["mfu"] == pytest.approx(6 * 1000 * 8 * 30 / 0.5 / 989e12)


@pytest.mark.parametrize("runner", ["cohort", "cohort-lowmem"])
def test_cohort_child_runs_exact_lengths_on_cpu(bench, runner):
    args = argparse.Namespace(size="tiny", device="cpu", warmup=1, steps=1, prompts=2, generations=2,
                              prompt_len=8, completion_len=12, token_budget=None, mem_cap=None,
                              compile_layers=False, lowmem_token_budget=64, lowmem_chunk_tokens=8,
                              lowmem_release_kv=True, chunk_tokens=None, profile_update=False,
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
    import cohort.trainer
    # the bench's patches are scoped to the run
    assert cohort.trainer._save.__name__ == "_save"
    assert cohort.trainer.PolicyUpdater.update.__name__ == "update"

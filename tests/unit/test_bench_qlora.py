"""bench/qlora.py on the CPU: its rows differ only in the two QLoRA settings, every row's config validates up to the
machine check (the QLoRA rows need CUDA and bitsandbytes), and the table reads the children's results, a failed row
included."""

from __future__ import annotations

import argparse

import pytest
from tests.helpers.bench_modules import load_bench

from cohort.errors import ConfigError


@pytest.fixture(scope="module")
def bench():
    return load_bench("qlora.py", "qlora_bench")


def _args(**over):
    base = dict(folder="/models/x", size="tiny", device="cuda", warmup=1, steps=2, prompts=4, generations=4,
                prompt_len=16, completion_len=16, lora_r=8, release_kv=False, gradient_checkpointing=False)
    return argparse.Namespace(**{**base, **over})


def test_rows_differ_only_in_the_quantization_settings(bench):
    configs = {row: bench.row_config(_args(), row, 0.2) for row in bench.ROWS}
    assert {r: (c.model.quantization, c.generation.quantized_engine, c.generation.lora_engine)
            for r, c in configs.items()} == {
        "lora": ("none", "merged_bf16", "adapters"), "lora-merged": ("none", "merged_bf16", "merged"),
        "qlora": ("nf4", "merged_bf16", "adapters"), "qlora-4bit": ("nf4", "4bit", "adapters")}
    plain = [c.to_dict() for c in configs.values()]
    for c in plain:
        c["model"].pop("quantization"), c["generation"].pop("quantized_engine"), c["run"].pop("output_dir")
        c["generation"].pop("lora_engine")
    assert plain[0] == plain[1] == plain[2] == plain[3]
    cfg = configs["lora"]
    assert (cfg.model.lora_r, cfg.model.lora_alpha, cfg.generation.ignore_eos, cfg.loss.beta) == (8, 16, True, 0.0)
    assert cfg.train.max_steps == 3 and cfg.generation.kv_cache_fraction == 0.2


def test_every_row_validates_and_qlora_names_what_the_machine_lacks(bench, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench.row_config(_args(), "lora", 0.2).validate()
    bench.row_config(_args(), "lora-merged", 0.2).validate()
    with pytest.raises(ConfigError, match=r"model.quantization='nf4'.*CUDA GPU"):
        bench.row_config(_args(), "qlora", 0.2).validate()


def test_table_reads_the_rows(bench):
    step = {"step": 2.0, "generate": 1.2, "score": 0.1, "update": 0.6, "sync_weights": 0.001, "mismatch": 0.01}
    ok = {"steps": [dict(step, step=9.0), step, step], "engine": "cohort engine", "loaded_gib": 0.4,
          "after_setup_gib": 3.1, "peak_alloc_gib": 9.5, "phase_peak_alloc_gib": {"generate": 3.5, "update": 9.5}}
    args = _args()
    ok["summary"] = bench.summarise(args, ok)
    assert ok["summary"]["step"] == 2.0 and ok["summary"]["measured_steps"] == 2  # the warm-up step left out
    assert ok["summary"]["gen_tok_s"] == pytest.approx(4 * 4 * 16 / 1.2)
    text = bench.table(args, {"lora": ok, "qlora": {"error": "CUDA out of memory"}})
    assert "| lora | 2.000 | 1.200 | 0.600 | 0.0010 | 213 | 0.40 | 3.10 | 9.50 (3.50 / 9.50) | 0.0100 |" in text
    assert "| qlora | failed: CUDA out of memory |" in text

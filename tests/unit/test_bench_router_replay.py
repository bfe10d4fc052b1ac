"""bench/router_replay.py on the CPU (--tiny): it samples with a recording engine in bf16, measures the training
forward's logprobs with and without router replay against the engine's, and writes its JSON and manifest."""

from __future__ import annotations

import json
import math

import torch
from tests.helpers.bench_modules import load_bench


def test_tiny_run_writes_both_modes_and_a_manifest(tmp_path):
    bench = load_bench("router_replay.py", "bench_router_replay")
    out = tmp_path / "router_replay.json"
    results = bench.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["files"] == ["router_replay.json"] and manifest["device"] == "cpu"
    assert results["dtype"] == "bfloat16" and results["completions"] == 8
    tokens = 8 * 16  # 4 prompts x 2 samples x 16 tokens (ignore_eos)
    for mode in ("no_replay", "replay"):
        r = results[mode]
        assert r["tokens"] == tokens
        assert math.isfinite(r["k3_mean"]) and r["k3_mean"] >= 0 and r["max_abs_diff"] >= r["mean_abs_diff"] >= 0
    agreement = results["routing_agreement_without_replay"]
    # the rows with a record at each of the 3 sparse layers: per prompt its 12 tokens once (shared by its 2
    # completions in the packed row) and each completion's 16 tokens but the last (never fed to the engine)
    assert agreement["token_layer_pairs"] == 3 * 4 * (12 + 2 * 15)
    assert 0.5 < agreement["topk_set_equal"] <= agreement["expert_overlap"] <= 1.0


def test_mismatch_numbers_by_hand():
    bench = load_bench("router_replay.py", "bench_router_replay")
    engine = torch.tensor([-1.0, -2.0])
    train = torch.tensor([-1.5, -2.0])
    r = bench.mismatch(engine, train)
    assert r["mean_abs_diff"] == 0.25 and r["max_abs_diff"] == 0.5 and r["tokens"] == 2
    assert math.isclose(r["k3_mean"], (math.exp(-0.5) - 1 + 0.5) / 2)

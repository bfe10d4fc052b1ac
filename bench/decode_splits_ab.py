"""A/B of the decode-attention kernel's flash-decoding splits: split by the table's width (a kernel file given
with --old, e.g. the previous commit's) against split by the live context (this checkout), at a 4k and a 32k
table (the engine's max_model_len: `cohort serve`'s default is now the model's context) and the contexts and
batches of a decode phase. Each cell is one layer's decode attention, timed as a CUDA graph (bench/engine_profile.py's
graph_ms), microseconds.

    git show HEAD~1:src/cohort/engine/triton_ops.py > /tmp/old_triton_ops.py
    python bench/decode_splits_ab.py --old /tmp/old_triton_ops.py --out $OUT/decode_splits.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/'s helpers
from engine_profile import a_like_tables, graph_ms, standalone_caches
from manifest import record_run

from cohort.engine import triton_ops


def load_kernels(path: str):
    spec = importlib.util.spec_from_file_location("old_triton_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="a triton_ops.py whose kernel splits the table's width")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128, help="128: Qwen2.5-1.5B; 64: 0.5B with --heads 14")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    old = load_kernels(args.old)
    caches = standalone_caches(args.kv_heads, args.head_dim, num_blocks=65536)
    kc, vc, block, nb = caches
    rows_out = []
    print("| rows x ctx | table | old us | new us | old / new |\n| --- | --- | ---: | ---: | ---: |")
    for rows, ctx in ((16, 1024), (16, 4096), (64, 1024), (64, 4352), (64, 8448), (256, 1024)):
        for table_len in (4352, 32768):
            width = -(-table_len // block)
            if ctx > width * block:
                continue
            q = torch.randn(rows, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
            tables = a_like_tables(rows, ctx, block, width, nb)
            lens = torch.full((rows,), ctx, device="cuda", dtype=torch.int32)
            times = [graph_ms(lambda ops=ops, q=q, tables=tables, lens=lens:
                              ops.paged_decode_attention(q, kc, vc, tables, lens, 0.088)) * 1000
                     for ops in (old, triton_ops)]
            ref = old.paged_decode_attention(q, kc, vc, tables, lens, 0.088)
            new = triton_ops.paged_decode_attention(q, kc, vc, tables, lens, 0.088)
            torch.testing.assert_close(new, ref, atol=2e-2, rtol=2e-2)
            rows_out.append({"rows": rows, "ctx": ctx, "table": table_len, "old_us": times[0], "new_us": times[1]})
            print(f"| {rows} x {ctx} | {table_len} | {times[0]:.1f} | {times[1]:.1f} | {times[0] / times[1]:.2f} |",
                  flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": rows_out}, fh, indent=1)
        record_run("bench/decode_splits_ab.py: decode attention split by the table vs by the live context", args.out)


if __name__ == "__main__":
    main()

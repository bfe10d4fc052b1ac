"""Where the GPU waits: the device timeline of a torch.profiler run, as busy time, idle gaps and their neighbours.

`summary(prof)` reads the profiler's device events (kernels, copies, memsets), merges their intervals and
prints the span from the first to the last, the time some kernel ran, the idle time, and the largest idle
gaps with the kernels on either side (which phase of the step the host was slow in). `save(prof, path)`
writes the Chrome trace gzipped, for a closer look where the device run came back from. `categories(prof)`
sums the device time by what the kernels do (matmuls, attention, SiLU, logprob, norms, optimizer, ...).
Used by bench/engine_profile.py (the engine loop without per-step synchronisation) and bench/grpo_step.py
(`--profile-update`: the update).
"""

from __future__ import annotations

import gzip
import os
import shutil
import tempfile


def _device_events(prof) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every device-side event, sorted by start. Not the device-side copies of
    user annotations (`Optimizer.step#...` and the like): they span the kernels they hold."""
    events = list(prof.profiler.kineto_results.events())
    # a device-side annotation carries the name of its host-side record_function range
    annotations = {e.name() for e in events if e.is_user_annotation()}
    out = []
    for e in events:
        if str(e.device_type()).endswith("CUDA") and e.duration_ns() > 0 and e.name() not in annotations:
            out.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    return sorted(out)


def summary(prof, label: str, top: int = 12, min_gap_us: float = 5.0) -> str:
    events = _device_events(prof)
    if not events:
        return f"{label}: no device events"
    busy = 0
    gaps = []
    cur_start, cur_end, cur_name = events[0]
    for start, end, name in events[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((start - cur_end, cur_name, name))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
        cur_name = name if end >= cur_end else cur_name
    busy += cur_end - cur_start
    span = events[-1][1] - events[0][0]
    big = [g for g in gaps if g[0] >= min_gap_us * 1000]
    lines = [f"{label}: device span {span / 1e6:.1f} ms, busy {busy / 1e6:.1f} ms ({100 * busy / span:.1f}%), "
             f"idle {(span - busy) / 1e6:.1f} ms in {len(gaps)} gaps ({len(big)} of >= {min_gap_us:.0f} us: "
             f"{sum(g[0] for g in big) / 1e6:.1f} ms); {len(events)} device events",
             "| idle us | after | before |", "| ---: | --- | --- |"]
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"| {gap / 1000:.0f} | {before[:70]} | {after[:70]} |")
    return "\n".join(lines)


# Device kernels by what they do, first match wins (names as the profiler reports them on an H100 with torch
# 2.11: cuBLAS's nvjet/cutlass GEMMs, torch's FlashAttention-2, inductor's fused Triton kernels named after the
# ops they fuse, cohort's Triton logprob kernels, the fused AdamW's multi-tensor kernels).
CATEGORIES = (
    ("attention", ("flash", "fmha", "cudnn", "attention")),  # before matmul: FA2's names hold cutlass types
    ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "splitk")),
    ("SiLU-and-multiply", ("silu",)),
    ("logprob", ("_stats_kernel", "_grad_kernel", "logprob", "arange_eq_exp")),
    ("norm", ("rsqrt", "pow_sum", "mean_mul_pow")),
    ("rotary", ("neg_slice", "neg_select", "mul_neg")),
    ("optimizer", ("multi_tensor_apply", "adam", "_master")),
    ("copy and fill", ("memcpy", "memset", "copy", "fill", "cat", "gather", "index")),
    ("add and cast", ("add", "to_copy", "convert", "elementwise", "reduce", "sum")),
)


def category(kernel_name: str) -> str:
    """The CATEGORIES entry a device kernel belongs to ("other" when none matches)."""
    name = kernel_name.lower()
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other"


def category_table(events) -> str:
    """Device time by category from (start ns, end ns, name) events: ms, share, kernel count, and the kernel of
    most time in each (to check what a category holds)."""
    from collections import Counter

    totals: dict[str, Counter] = {}
    counts: Counter = Counter()
    for start, end, name in events:
        label = category(name)
        totals.setdefault(label, Counter())[name] += end - start
        counts[label] += 1
    whole = sum(sum(c.values()) for c in totals.values()) or 1
    lines = ["| kernels | ms | share | count | largest |", "| --- | ---: | ---: | ---: | --- |"]
    for label, names in sorted(totals.items(), key=lambda kv: -sum(kv[1].values())):
        ns = sum(names.values())
        top = names.most_common(1)[0][0][:60]
        lines.append(f"| {label} | {ns / 1e6:.1f} | {100 * ns / whole:.1f}% | {counts[label]} | {top} |")
    lines.append(f"| all | {whole / 1e6:.1f} | 100% | {len(events)} | |")
    return "\n".join(lines)


def categories(prof) -> str:
    """`category_table` of a profiler run's device events."""
    return category_table(_device_events(prof))


def save(prof, path: str) -> None:
    """The Chrome trace, gzipped, at `path` (a .json.gz)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)


def host_ops_in_gaps(trace_path: str, min_gap_us: float = 1000.0, top_ops: int = 8) -> str:
    """From a saved Chrome trace: each device idle gap of at least `min_gap_us`, with the host's operators
    (torch ops and CUDA runtime calls, by total time overlapping the gap) that ran while the device waited.

        python bench/trace_gaps.py TRACE.json.gz [MIN_GAP_US]
    """
    import json
    from collections import Counter

    with gzip.open(trace_path, "rt") if trace_path.endswith(".gz") else open(trace_path) as fh:
        events = json.load(fh)["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    host = [e for e in spans if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation",
                                                 "python_function")]
    lines = [f"{trace_path}: {len(device)} device events, {len(host)} host events"]
    end = device[0][1] if device else 0
    for start, stop in device[1:]:
        if start - end >= min_gap_us:
            overlap: Counter = Counter()
            for e in host:
                lo, hi = max(e["ts"], end), min(e["ts"] + e["dur"], start)
                if hi > lo:
                    overlap[e["name"][:80]] += hi - lo
            ops = ", ".join(f"{name} {us / 1000:.2f} ms" for name, us in overlap.most_common(top_ops))
            lines.append(f"gap {(start - end) / 1000:.2f} ms at +{(end - device[0][0]) / 1000:.1f} ms: {ops}")
        end = max(end, stop)
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(host_ops_in_gaps(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 1000.0))

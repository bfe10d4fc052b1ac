"""How busy the GPU is during a timed region: torch.profiler's kernel intervals, merged, against wall time.

    with device_trace("out.txt", label="multi-turn"):
        run()

writes a short text report: wall seconds, GPU-busy seconds (the union of every kernel and copy interval, so
overlapping streams count once), the idle share, the longest idle gaps with the host operation that was running
at their start, and the kernels and host operations that took the most time. A host-bound workload shows as a
large idle share; a device-bound one as busy ~= wall. Used by bench/turns.py --trace (diagnosis only: the
profiler slows the host, compare rows within one traced run).
"""

from __future__ import annotations

import contextlib
import time


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _report(prof, wall: float, label: str) -> str:
    from torch.autograd import DeviceType

    events = list(prof.events())
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    spans = _merge([(e.time_range.start, e.time_range.end) for e in device])  # microseconds
    busy = sum(b - a for a, b in spans) / 1e6
    gaps = sorted(((spans[i + 1][0] - spans[i][1], spans[i][1]) for i in range(len(spans) - 1)), reverse=True)
    host = [e for e in events if e.device_type != DeviceType.CUDA]

    def host_at(t: float) -> str:
        # the innermost host op running at time t (shortest one that contains it)
        around = [e for e in host if e.time_range.start <= t <= e.time_range.end]
        return min(around, key=lambda e: e.time_range.end - e.time_range.start).name if around else "-"

    lines = [f"## {label}", f"wall {wall:.4f} s, GPU busy {busy:.4f} s ({busy / max(wall, 1e-9):.0%}), "
             f"{len(device)} device events", "", "longest idle gaps (ms, host op at their start):"]
    lines += [f"  {g / 1e3:8.2f}  {host_at(t)}" for g, t in gaps[:15]]
    totals: dict[str, list[float]] = {}
    for e in device:
        t = totals.setdefault(e.name[:90], [0.0, 0])
        t[0] += e.time_range.end - e.time_range.start
        t[1] += 1
    lines += ["", "device time by kernel (ms, count):"]
    lines += [f"  {v[0] / 1e3:8.2f} {int(v[1]):6d}  {k}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1][0])[:25]]
    lines += ["", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def device_trace(path: str, label: str = ""):
    """Profile the block (CPU + CUDA activities) and append the report to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with open(path, "a") as f:
        f.write(_report(prof, wall, label))

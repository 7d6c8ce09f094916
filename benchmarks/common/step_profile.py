"""Where the time of Mamba2 steps goes, read from a ``torch.profiler`` trace.

The caller runs each step inside a profiler range whose name starts with a prefix (say
``step:mixed#0``), waits for the device at its end, and passes each step's kind and wall
time to ``summarize``. Every device kernel (on a CPU run: every op's self time) is then attributed

- to the step whose range was open at its launch call (``cudaLaunchKernel``,
  ``cuLaunchKernelEx``, ``cudaGraphLaunch``, ``cudaMemcpyAsync``, ..., found through the
  CUDA correlation id the two share); failing that, the step its execution falls in (the
  step waits for the device before its range closes);
- to a category: launched inside ``mamba2::conv`` -> conv, inside ``mamba2::ssm_scan`` ->
  scan (``MambaMixer2`` opens both ranges while the profiler records); otherwise by kernel
  name: ``conv1d`` -> conv, GEMM kernels -> matmul, anything else -> other.

Kernels replayed from a CUDA graph were launched by ``cudaGraphLaunch`` and carry no
ranges, so in a graphed step only the name rules apply: the PyTorch scan's kernels
(elementwise, gathers, a batched GEMV) count as other, or as matmul where they are GEMMs;
``attributed_by`` says which rule a step kind went through. Per step kind the summary gives
the mean wall time, the mean time of each category and ``idle``: wall time with no kernel
running (host work, launch gaps and syncs); the categories and idle add up to the wall time.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass

CATEGORIES = ("conv", "scan", "matmul", "other")
RANGE_CATEGORY = {"mamba2::conv": "conv", "mamba2::ssm_scan": "scan"}
_MATMUL = re.compile(
    r"gemm|cutlass|cublas|nvjet|xmma|wgmma|aten::(?:mm|addmm|bmm|matmul|linear|einsum)$",
    re.IGNORECASE,
)
_LAUNCH = re.compile(r"^cu(?:da)?(?:Launch|GraphLaunch|Memcpy|Memset|LaunchKernel)")


@dataclass(frozen=True)
class KernelRecord:
    """One kernel (or, on CPU, one op's self time) and the ranges open at its launch,
    outermost first."""

    name: str
    duration_us: float
    ranges: tuple[str, ...]


def category(rec: KernelRecord) -> str:
    for name in reversed(rec.ranges):
        if name in RANGE_CATEGORY:
            return RANGE_CATEGORY[name]
    if "conv1d" in rec.name:
        return "conv"
    if _MATMUL.search(rec.name):
        return "matmul"
    return "other"


def _ranges_at(times: list[float], spans: list[tuple[float, float, str]]) -> list[tuple]:
    """For each time, the names of the (properly nested) spans containing it."""
    spans = sorted(spans, key=lambda s: (s[0], -s[1]))
    out: list[tuple] = [()] * len(times)
    stack: list[tuple[float, float, str]] = []
    j = 0
    for i in sorted(range(len(times)), key=times.__getitem__):
        t = times[i]
        while j < len(spans) and spans[j][0] <= t:
            while stack and stack[-1][1] <= spans[j][0]:
                stack.pop()
            stack.append(spans[j])
            j += 1
        while stack and stack[-1][1] < t:
            stack.pop()
        out[i] = tuple(s[2] for s in stack if s[1] >= t)
    return out


def kernel_records(events, step_prefix: str, on_cuda: bool) -> list[KernelRecord]:
    """The kernels of a profile (``prof.events()``) with the ranges open at their launch.

    On CUDA: device kernels, memcpys and memsets, with the ranges open at their launch call;
    a kernel whose launch call was not recorded gets the step range its execution falls in
    (each step waits for the device before its range closes) and no mamba2 range. On CPU:
    every CPU event's self time, at its start (a range's own self time is the Python
    between its ops).
    """
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    mamba_spans = [
        (e.time_range.start, e.time_range.end, e.name) for e in cpu if e.name in RANGE_CATEGORY
    ]
    step_spans = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in cpu
        if e.name.startswith(step_prefix)
    ]
    all_spans = step_spans + mamba_spans
    if not on_cuda:
        return _self_time_records(cpu, all_spans)
    launch_time = {e.id: e.time_range.start for e in cpu if _LAUNCH.match(e.name)}
    kernels = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    launched = [launch_time.get(e.id) for e in kernels]
    at_launch = _ranges_at([-math.inf if t is None else t for t in launched], all_spans)
    # A kernel whose launch call was not recorded: its step from when it ran.
    at_run = _ranges_at([e.time_range.start for e in kernels], step_spans)
    return [
        KernelRecord(e.name, float(e.time_range.end - e.time_range.start), r if t is None else a)
        for e, t, a, r in zip(kernels, launched, at_launch, at_run, strict=True)
    ]


def _self_time_records(cpu, spans) -> list[KernelRecord]:
    ranges = _ranges_at([e.time_range.start for e in cpu], spans)
    return [
        KernelRecord(e.name, float(e.self_cpu_time_total), r)
        for e, r in zip(cpu, ranges, strict=True)
    ]


def host_records(events, step_prefix: str) -> list[KernelRecord]:
    """The host's side of a profile, on CPU and CUDA runs alike: every CPU event's self
    time (aten ops, CUDA runtime calls such as kernel launches and syncs, and the ranges'
    own self time, which is the Python between their ops), with the step range open at its
    start."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in cpu]
    steps = [s for s in spans if s[2].startswith(step_prefix)]
    return _self_time_records(cpu, steps)


def top_by_name(records, step_range_prefix: str, num_steps: int, top: int = 15) -> list[dict]:
    """The records of the steps whose range starts with ``step_range_prefix`` (one step
    kind, e.g. ``step:mixed#``), summed by name: us per step and calls per step, largest
    first."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for rec in records:
        if any(r.startswith(step_range_prefix) for r in rec.ranges):
            total[rec.name] += rec.duration_us
            count[rec.name] += 1
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    return [
        {"name": k[:90], "us_per_step": total[k] / num_steps, "per_step": count[k] / num_steps}
        for k in ranked
    ]


def step_of(rec: KernelRecord, step_prefix: str) -> str | None:
    """The step range (name starting with ``step_prefix``) the record ran in, or None."""
    return next((r for r in rec.ranges if r.startswith(step_prefix)), None)


def summarize(
    records: list[KernelRecord],
    steps: dict[str, tuple[str, float]],
    step_prefix: str,
    graphed_kinds: tuple[str, ...] = (),
) -> dict:
    """Per step kind: steps, mean wall/device/idle ms, mean ms and share per category (of the
    wall, or of the device time where the profiled ops sum past the wall).

    ``steps`` maps each step range's name to (its kind, its measured wall ms);
    ``graphed_kinds`` are the kinds that ran as CUDA-graph replays (attributed by kernel
    names only).
    """
    per_step: dict[str, dict[str, float]] = {name: defaultdict(float) for name in steps}
    unattributed_us = 0.0
    for rec in records:
        step = step_of(rec, step_prefix)
        if step in per_step:
            per_step[step][category(rec)] += rec.duration_us / 1e3
        else:
            unattributed_us += rec.duration_us
    kinds: dict[str, list[str]] = defaultdict(list)
    for name, (kind, _) in steps.items():
        kinds[kind].append(name)
    out: dict = {}
    for kind, names in kinds.items():
        wall = statistics.fmean(steps[n][1] for n in names)
        cat_ms = {c: statistics.fmean(per_step[n][c] for n in names) for c in CATEGORIES}
        device = sum(cat_ms.values())
        idle = max(0.0, wall - device)
        # Shares of the larger of the two: on a loaded CPU the profiled run's ops can sum past
        # the separately timed wall, and shares must still add up to 1.
        base = max(wall, device)
        out[kind] = {
            "steps": len(names),
            "wall_ms": wall,
            "device_ms": device,
            "idle_ms": idle,
            "ms": cat_ms,
            "share": {
                **{c: cat_ms[c] / base if base else 0.0 for c in CATEGORIES},
                "idle": idle / base if base else 0.0,
            },
            "attributed_by": "kernel names (CUDA graph)"
            if kind in graphed_kinds
            else "profiler ranges, then kernel names",
        }
    out["_unattributed_ms"] = unattributed_us / 1e3
    return out


def markdown_rows(label: str, summary: dict) -> list[str]:
    """Table rows ``| label | kind | steps | wall ms | conv | scan | matmul | other | idle |``."""
    rows = []
    for kind, s in summary.items():
        if kind.startswith("_"):
            continue
        shares = " | ".join(f"{100 * s['share'][c]:.1f}%" for c in (*CATEGORIES, "idle"))
        note = " (graph: names only)" if "graph" in s["attributed_by"] else ""
        rows.append(f"| {label} | {kind}{note} | {s['steps']} | {s['wall_ms']:.2f} | {shares} |")
    return rows


MARKDOWN_HEADER = [
    "| run | step | steps | wall ms | conv | scan | matmul | other | idle (host) |",
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
]

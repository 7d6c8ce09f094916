"""The timing, profile and markdown table of benchmark_mamba2_step.py: each step timed
(CUDA events, or ``time.perf_counter`` on the CPU), the profiled steps split by
``step_profile.py``, and the results as one markdown report."""

from __future__ import annotations

import statistics
import time

from benchmarks.common.run_info import quantiles
from benchmarks.common.step_profile import (
    MARKDOWN_HEADER,
    host_records,
    kernel_records,
    markdown_rows,
    summarize,
    top_by_name,
)

STEP_PREFIX = "step:"


def timed(fn, iters: int, warmup: int, on_cuda: bool) -> dict:
    import torch

    for _ in range(warmup):
        fn()
    if on_cuda:
        torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(iters):
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        if on_cuda:
            end.record()
            end.synchronize()
            walls.append(start.elapsed_time(end))
        else:
            walls.append(host * 1e3)
        hosts.append(host * 1e3)
    return {"ms": quantiles(walls), "host_ms": statistics.median(hosts), "samples_ms": walls}


def profile_steps(steps: dict, n: int, on_cuda: bool, graphed: tuple[str, ...]) -> dict:
    """Run ``n`` of each step under the profiler; the step_profile summary per kind."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    walls = {}
    with profile(activities=activities) as prof:
        for kind, fn in steps.items():
            for i in range(n):
                name = f"{STEP_PREFIX}{kind}#{i}"
                t0 = time.perf_counter()
                with record_function(name):
                    fn()
                    if on_cuda:
                        torch.cuda.synchronize()
                walls[name] = (kind, (time.perf_counter() - t0) * 1e3)
    events = prof.events()
    records = kernel_records(events, STEP_PREFIX, on_cuda)
    kernels = top_by_name(records, f"{STEP_PREFIX}decode_graph#", n)
    host = host_records(events, STEP_PREFIX)
    host_ops = {
        kind: top_by_name(host, f"{STEP_PREFIX}{kind}#", n) for kind in steps if kind not in graphed
    }
    return summarize(records, walls, STEP_PREFIX, graphed), kernels, host_ops


def markdown(results: dict) -> str:
    s = results["setup"]
    lines = [
        f"Mamba2 step, {s['model']} shape, {s['dtype']}, {s['device']}: mixed = "
        f"{s['num_decodes']} decodes + 1 x {s['prefill_len']} prefill, decode = "
        f"{s['decode_batch']} decodes (median of {s['iters']}, ms)",
        "",
        "| backend | step | tokens | ms (median) | p20 | p80 | host ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, res in results["backends"].items():
        if "skipped" in res:
            lines.append(f"| {name} | skipped: {res['skipped']} | | | | | |")
            continue
        for kind in ("mixed", "mixed_graph", "decode", "decode_graph"):
            if kind in res:
                r, tokens = res[kind], s["tokens"][kind.replace("_graph", "")]
                lines.append(
                    f"| {name} | {kind} | {tokens} | {r['ms']['median']:.2f} | "
                    f"{r['ms']['p20']:.2f} | {r['ms']['p80']:.2f} | {r['host_ms']:.2f} |"
                )
    speedups = results.get("triton_over_cuda")
    if speedups:
        lines += [
            "",
            "Triton over CUDA (CUDA ms / Triton ms): "
            + ", ".join(f"{k} {v:.3f}x" for k, v in speedups.items()),
        ]
    floors = [(n, r["decode_floor"]) for n, r in results["backends"].items() if "decode_floor" in r]
    if floors:
        lines += [
            "",
            "Decode graph step against its byte floor (weights + states read and written once, "
            "at the measured copy bandwidth):",
            "",
            "| backend | batch | GB | copy GB/s | floor ms | graph ms | graph / floor |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, f in floors:
            ms = results["backends"][name]["decode_graph"]["ms"]["median"]
            lines.append(
                f"| {name} | {f['batch']} | {f['bytes'] / 1e9:.2f} | {f['copy_gbps']:.0f} | "
                f"{f['floor_ms']:.2f} | {ms:.2f} | {f['graph_over_floor']:.3f}x |"
            )
    for name, r in results["backends"].items():
        if r.get("decode_graph_kernels"):
            lines += ["", f"Kernels of the decode graph step ({name}):", ""]
            lines += ["| kernel | us per step | launches per step |", "| --- | ---: | ---: |"]
            for k in r["decode_graph_kernels"]:
                lines.append(f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['per_step']:.0f} |")
    for name, r in results["backends"].items():
        for kind, ops in r.get("host_ops", {}).items():
            lines += ["", f"Host self time of the {kind} step by event ({name}):", ""]
            lines += ["| event | us per step | calls per step |", "| --- | ---: | ---: |"]
            for k in ops:
                lines.append(f"| `{k['name']}` | {k['us_per_step']:.1f} | {k['per_step']:.1f} |")
    profiles = [(n, r["profile"]) for n, r in results["backends"].items() if "profile" in r]
    if profiles:
        lines += ["", "Share of step wall time (profiled steps):", "", *MARKDOWN_HEADER]
        for name, prof in profiles:
            lines += markdown_rows(name, prof)
    return "\n".join(lines)

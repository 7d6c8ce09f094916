"""The SSD benchmark's report (benchmark_ssd.py): the environment block (GPU, versions, git
sha, the command line), the markdown table with its notes, and the one-line-per-case
summary printed at the end.
"""

from __future__ import annotations

import shlex
from datetime import datetime, timezone
from pathlib import Path


def environment(args, rates) -> dict:
    import torch
    import triton

    from benchmarks.common.run_info import git_sha

    return {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "git_sha": git_sha(),
        "command": "python " + shlex.join(["benchmarks/kernels/benchmark_ssd.py", *args.argv]),
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "dtype": str(args.dtype).removeprefix("torch."),
        "state_dtype": str(args.state_dtype).removeprefix("torch."),
        **{k: round(v, 1) for k, v in rates.items()},
    }


def _f(v, d=1) -> str:
    return "" if v != v else f"{v:.{d}f}"  # NaN -> empty


def markdown(env, results, ops) -> str:
    mamba, upstream = ops.get("mamba_ssm"), ops.get("upstream")
    lines = [
        "# SSD (Mamba2 chunked scan) benchmark",
        "",
        f"- GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}); triton {env['triton']}",
        f"- git: {env['git_sha']}; {env['date_utc']} UTC",
        f"- command: `{env['command']}`",
        f"- {env['dtype']} activations, {env['state_dtype']} state pool. us: cold L2, one call, "
        "~2 ms GPU sleep before it (host work hidden), median [p20, p80]; cold200: the same "
        "with a 200 us sleep; graph: CUDA-graph replay per call (warm L2); host: eager loop "
        "per call; plan = host layout build (outside the timed call)",
        f"- device copy {env['copy_gbps']:.0f} GB/s, bf16 matmul {env['matmul_tflops']:.0f} "
        "TFLOP/s (both measured at the start of this run)",
        "- mamba_ssm: "
        + (
            f"{mamba.version} ({mamba.path})"
            if hasattr(mamba, "version")
            else str(mamba or "not requested")
        ),
        "- upstream: "
        + (
            f"vLLM 0.33.0 Triton SSD ({Path(upstream.__file__).parent})"
            if hasattr(upstream, "__file__")
            else str(upstream or "not requested")
        ),
        "",
        "| case | provider | status | us [p20, p80] | cold200 | graph | host | plan us | GFLOP "
        "| MB | TFLOP/s | GB/s | % copy | % mm | y rel-L2 | state rel-L2 | / best peer |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for r in results:
        status = r.status
        if r.note:
            notes.append(f"{r.case} / {r.provider}: {r.note}")
            status += f" [{len(notes)}]"
        time_cell = f"{r.us:.1f} [{r.p20:.1f}, {r.p80:.1f}]" if r.status == "ok" else ""
        err = "" if r.y_rel_l2 != r.y_rel_l2 else f"{r.y_rel_l2:.1e}"
        serr = "" if r.state_rel_l2 != r.state_rel_l2 else f"{r.state_rel_l2:.1e}"
        lines.append(
            f"| {r.case} | {r.provider} | {status} | {time_cell} | {_f(r.cold200)} | "
            f"{_f(r.graph)} | {_f(r.host)} | {_f(r.plan_us)} | "
            f"{r.gflop:.4g} | {r.mbytes:.4g} | {_f(r.tflops)} | {_f(r.gbps)} | "
            f"{_f(r.pct_copy)} | {_f(r.pct_mm)} | {err} | {serr} | {_f(r.vs_best_peer, 2)} |"
        )
    lines += ["", *(f"[{i}] {n}" for i, n in enumerate(notes, 1))]
    return "\n".join(lines) + "\n"


def summary(results) -> str:
    """One line per case: each provider's time (us, cold), and ours over the best peer's."""
    cases = list(dict.fromkeys(r.case for r in results))
    names = list(dict.fromkeys(r.provider for r in results))
    lines = ["case".ljust(20) + "".join(n.rjust(17) for n in names) + "   ours/best peer"]
    for case in cases:
        row = {r.provider: r for r in results if r.case == case}
        cells = []
        for n in names:
            r = row.get(n)
            cells.append((f"{r.us:.1f}" if r is not None and r.status == "ok" else
                          (r.status if r is not None else "")).rjust(17))  # fmt: skip
        ours = row.get("triton")
        ratio = _f(ours.vs_best_peer, 2) if ours is not None else ""
        lines.append(case.ljust(20) + "".join(cells) + ratio.rjust(18))
    return "\n".join(lines)

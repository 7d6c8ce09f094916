"""The causal-conv1d benchmark's result row and report (benchmark_causal_conv1d.py): the
``Result`` of one provider on one case (the CSV's columns), the environment block (GPU,
versions, git sha, the command line), the markdown tables per kind and dim, and the plot.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import triton

from benchmarks.kernels.conv1d_bench_cases import NUM_LINES, WIDTH
from benchmarks.kernels.conv1d_bench_providers import PROVIDERS
from vllm import _custom_ops as cuda_ops

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Result:
    kind: str
    dim: int
    case: str
    tokens: int
    seqs: int
    provider: str
    mbytes: float
    status: str = "ok"  # ok, FAIL (wrong results), ERROR (raised), n/a
    max_abs_err: float = math.nan
    rel_l2: float = math.nan
    states_exact: bool | None = None
    cold_us: float = math.nan
    cold_p20: float = math.nan
    cold_p80: float = math.nan
    graph_us: float = math.nan
    graph_p20: float = math.nan
    graph_p80: float = math.nan
    host_us: float = math.nan
    cold_gbps: float = math.nan
    cold_pct_copy: float = math.nan
    graph_gbps: float = math.nan
    graph_pct_copy: float = math.nan
    note: str = ""


def environment(args, copy_start) -> dict:
    def git(*cmd):
        try:
            return subprocess.run(
                ["git", "-C", str(REPO), *cmd], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    # VLLM_RUN_SHA: see benchmarks/common/run_info.py (a copied tree may carry a stale .git).
    sha = os.environ.get("VLLM_RUN_SHA")
    if not sha:
        sha = git("rev-parse", "HEAD")
        if sha is not None and git("status", "--porcelain", "--untracked-files=no"):
            sha += " (with uncommitted changes)"
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "git_sha": sha or "unknown (no git repository)",
        "command": "python " + shlex.join([str(Path(sys.argv[0])), *sys.argv[1:]]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "copy_gbps_start": round(copy_start, 1),
        "quick": args.quick,
        "dtype": "bf16",
        "width": WIDTH,
        "cuda_ops": "built" if cuda_ops.cuda_ops_available() else "not built",
    }


def _fmt(v, digits=1):
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _cell_time(r: Result, which: str) -> str:
    if r.status != "ok":
        return r.status
    med, lo, hi = (
        getattr(r, f"{which}_us"),
        getattr(r, f"{which}_p20"),
        getattr(r, f"{which}_p80"),
    )
    if math.isnan(med):
        return ""
    digits = 2 if med < 100 else 1
    return f"{med:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def markdown(env, results, copy_end, dao_note) -> str:
    lines = [
        "# Causal-conv1d benchmark",
        "",
        f"- GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}); triton {env['triton']}",
        f"- git: {env['git_sha']}; {env['date_utc']} UTC",
        f"- command: `{env['command']}`",
        f"- device copy (4 GiB `b.copy_(a)`, cold median): {env['copy_gbps_start']:.0f} GB/s at "
        f"the start, {copy_end:.0f} GB/s at the end; % copy is of the first",
        f"- bf16, width {WIDTH}, SiLU, bias; pools of {NUM_LINES} lines, shuffled lines",
        f"- providers: triton (ours), cuda (ours: {env['cuda_ops']}), torch (fp32 "
        f"reference), dao ({dao_note})",
        "- times in us: median [p20, p80]. cold = GPU time, L2 flushed, host hidden; graph = "
        "per call in a CUDA graph, warm L2; host = one eager call, back to back. "
        "GB/s and % copy: bytes moved / cold time (graph time for decode)",
        "",
    ]
    providers = [p for p in PROVIDERS if any(r.provider == p for r in results)]
    for kind in ("prefill", "mixed", "decode"):
        for dim in sorted({r.dim for r in results if r.kind == kind}):
            rows = [r for r in results if r.kind == kind and r.dim == dim]
            lines += _kind_table(kind, dim, rows, providers)
    failed = [r for r in results if r.status in ("FAIL", "ERROR")]
    if failed:
        lines += ["## Failures", ""]
        lines += [
            f"- {r.kind} D={r.dim} {r.case} {r.provider}: {r.status} {r.note}" for r in failed
        ]
        lines.append("")
    notes = sorted({f"{r.provider}: {r.note}" for r in results if r.note and r.status == "ok"})
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _kind_table(kind, dim, rows, providers) -> list[str]:
    """One row per case; per provider its time columns, % copy and host cost. A provider
    that did not run (n/a everywhere) and columns with no value at all are left out."""
    primary = "graph" if kind == "decode" else "cold"
    pct = "graph_pct_copy" if kind == "decode" else "cold_pct_copy"
    metrics = {
        "prefill": [
            ("cold us", "cold"),
            ("GB/s", "cold_gbps"),
            ("% copy", pct),
            ("host us", "host_us"),
        ],
        "mixed": [
            ("cold us", "cold"),
            ("% copy", pct),
            ("graph us", "graph"),
            ("host us", "host_us"),
        ],
        "decode": [
            ("graph us", "graph"),
            ("cold us", "cold"),
            ("% copy", pct),
            ("host us", "host_us"),
        ],
    }[kind]

    def cell(r: Result | None, metric: str) -> str:
        if r is None:
            return ""
        if metric in ("cold", "graph"):
            return _cell_time(r, metric)
        return (
            _fmt(getattr(r, metric), 0 if metric.endswith("gbps") else 1)
            if r.status == "ok"
            else ""
        )

    labels = list(dict.fromkeys(r.case for r in rows))
    by_case = {label: {r.provider: r for r in rows if r.case == label} for label in labels}
    columns = [
        ("case", lambda label: label),
        ("MB", lambda label: f"{by_case[label][next(iter(by_case[label]))].mbytes:.1f}"),
    ]
    for p in providers:
        if all(
            by_case[label].get(p) is None or by_case[label][p].status == "n/a" for label in labels
        ):
            continue
        for title, metric in metrics:
            columns.append(
                (f"{p} {title}", lambda label, p=p, m=metric: cell(by_case[label].get(p), m))
            )
    if "triton" in providers and "cuda" in providers:

        def ratio(label):
            t, c = by_case[label].get("triton"), by_case[label].get("cuda")
            if t and c and t.status == c.status == "ok":
                return _fmt(getattr(c, f"{primary}_us") / getattr(t, f"{primary}_us"), 2)
            return ""

        columns.append((f"cuda/triton {primary} time", ratio))
    table = [[fn(label) for _, fn in columns] for label in labels]
    keep = [i for i in range(len(columns)) if i < 2 or any(row[i] for row in table)]
    head = [columns[i][0] for i in keep]
    out = [f"## {kind}, dim {dim}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row[i] for i in keep) + " |" for row in table]
    return out + [""]


def plot(results, path: Path, copy) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot"
    ok = [r for r in results if r.status == "ok"]
    dims = sorted({r.dim for r in ok})
    if not dims:
        return "nothing to plot"
    fig, axes = plt.subplots(len(dims), 3, figsize=(16, 4.2 * len(dims)), squeeze=False)
    for row, dim in zip(axes, dims, strict=True):
        ax = row[0]
        for p in PROVIDERS:
            for seqs, style in ((16, "-o"), (1, "--x")):
                pts = [
                    (r.tokens, r.cold_pct_copy)
                    for r in ok
                    if r.kind == "prefill" and r.dim == dim and r.provider == p and r.seqs == seqs
                ]
                if pts:
                    ax.plot(*zip(*sorted(pts), strict=True), style, label=f"{p} x{seqs}")
        ax.set(
            xscale="log",
            xlabel="tokens",
            ylabel="% of copy bandwidth (cold)",
            title=f"prefill, dim {dim}",
            ylim=(0, 100),
        )
        for ax, kind, which, xlabel in (
            (row[1], "mixed", "cold", "decodes"),
            (row[2], "decode", "graph", "batch"),
        ):
            for p in PROVIDERS:
                pts = [
                    (r.seqs - (kind == "mixed"), getattr(r, f"{which}_us"))
                    for r in ok
                    if r.kind == kind and r.dim == dim and r.provider == p
                ]
                pts = [pt for pt in pts if not math.isnan(pt[1])]
                if pts:
                    ax.plot(*zip(*sorted(pts), strict=True), "-o", label=p)
            ax.set(
                xscale="log",
                yscale="log",
                xlabel=xlabel,
                ylabel=f"{which} us",
                title=f"{kind}, dim {dim}",
            )
        for ax in row:
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"causal-conv1d, bf16, width {WIDTH} (copy {copy:.0f} GB/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)

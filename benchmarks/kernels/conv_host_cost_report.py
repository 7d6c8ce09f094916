"""The host-cost benchmark's report (benchmark_conv_host_cost.py): the environment block
(device, versions, launches real or stubbed, git sha, the command line) and the markdown:
the per-case table against the targets, the pieces of the host path, the cProfile lists.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from typing import TYPE_CHECKING

import torch
import triton

from benchmarks.common.run_info import git_sha

if TYPE_CHECKING:
    from benchmarks.kernels.benchmark_conv_host_cost import Setup


def environment(s: Setup, stub: bool) -> dict:
    cuda = s.device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
        "launches": "stubbed (host path only)" if stub else "real",
        "dtype": str(s.dtype).replace("torch.", ""),
        "dim": s.dim,
        "git_sha": git_sha(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": shlex.join([sys.executable, *sys.argv]),
    }


def markdown(res: dict) -> str:
    env = res["environment"]
    lines = [
        "# causal-conv1d host cost per eager call",
        "",
        f"- {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['dtype']}, "
        f"dim {env['dim']}; launches {env['launches']}",
        f"- git {env['git_sha']}; {env['date_utc']} UTC; `{env['command']}`",
        "",
        "| case | loop us/call [p20, p80] | enqueue us/call | target us | met |",
        "|---|---|---|---|---|",
    ]
    for name, row in res["cases"].items():
        lp, eq = row["loop_us"], row["enqueue_us"]
        target = row.get("target_us")
        met = "" if target is None else ("yes" if row["met"] else "no")
        lines.append(
            f"| {name} | {lp['median']:.2f} [{lp['p20']:.2f}, {lp['p80']:.2f}] | "
            f"{eq['median']:.2f} | {'' if target is None else target} | {met} |"
        )
    bd = res["breakdown"]
    if bd.get("available"):
        names = sorted({p for row in bd["cases"].values() for p in row})
        head = "| case | " + " | ".join(names) + " |"
        rule = "|---" * (len(names) + 1) + "|"
        lines += [
            "",
            "Pieces of the host path, each timed alone (enqueue us/call):",
            "",
            head,
            rule,
        ]
        for case, row in bd["cases"].items():
            cells = [f"{row[n]:.2f}" if n in row else "" for n in names]
            lines.append(f"| {case} | " + " | ".join(cells) + " |")
    for case, rows in res.get("profile", {}).items():
        lines += ["", f"cProfile, {case} (own us per call, inflated by the profiler):", ""]
        lines += [f"- {r['own_us_per_call']:.2f} {r['function']}" for r in rows[:8]]
    return "\n".join(lines) + "\n"

"""What the end-to-end and step benchmarks share: the code version a run names, the Triton
version, why a run cannot use the CUDA conv backend, the median and p20/p80 of timing
samples, and writing the results files.

``VLLM_RUN_SHA``, when set, is taken as it is: a machine that gets a copy of the working
tree may carry a stale ``.git`` (the GPU box's did), so whoever launches the run there
passes the commit it really is, e.g. ``VLLM_RUN_SHA=$(git rev-parse --short HEAD)`` in
the command line built on the development machine. Without it, a tree whose tracked
files differ from its HEAD is named ``<sha>+modified``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from pathlib import Path


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, check=True)
    return out.stdout.strip()


def git_sha(cwd: Path | None = None) -> str:
    """``VLLM_RUN_SHA`` when set; else HEAD's short sha, with ``+modified`` when tracked
    files differ from it (uncommitted changes, or a copied tree over a stale ``.git``)."""
    given = os.environ.get("VLLM_RUN_SHA")
    if given:
        return given
    cwd = cwd or Path(__file__).parent
    try:
        sha = _git(cwd, "rev-parse", "--short", "HEAD")
        changed = _git(cwd, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+modified" if changed else "")


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def quantiles(samples: list[float]) -> dict:
    """Median, p20 and p80 of ``samples`` (one sample: itself for all three)."""
    if len(samples) > 1:
        p20, _, _, p80 = statistics.quantiles(samples, n=5, method="inclusive")
    else:
        p20 = p80 = samples[0]
    return {"median": statistics.median(samples), "p20": p20, "p80": p80}


def cuda_skip_reason(on_cuda: bool) -> str | None:
    """Why a run cannot use the CUDA conv backend, or None when it can."""
    if not on_cuda:
        return "the CUDA conv ops run on CUDA tensors only (this run is on the CPU)"
    from vllm import _custom_ops

    if not _custom_ops.cuda_ops_available():
        return (
            "the CUDA conv ops are not built (vllm._custom_ops.cuda_ops_available() is False; "
            "build with VLLM_BUILD_CUDA_OPS=1 pip install --no-deps --no-build-isolation -e .)"
        )
    return None


def write_results(results: dict, out: str | None, md: str | None) -> None:
    """The results as JSON at ``out`` and their ``"markdown"`` at ``md`` (each if given)."""
    if out:
        Path(out).write_text(json.dumps(results, indent=2, default=str))
    if md:
        Path(md).write_text(results["markdown"])

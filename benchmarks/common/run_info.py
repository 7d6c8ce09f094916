"""What the benchmarks share: the code version a run names (``git_sha``, the one copy in
vllm/benchmarks/utils.py, which the serving benchmark uses too; ``VLLM_RUN_SHA`` overrides
it), the Triton version, why a run cannot use the CUDA conv backend, the median and p20/p80
of timing samples, and writing the results files.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from vllm.benchmarks.utils import git_sha

__all__ = ["cuda_skip_reason", "git_sha", "quantiles", "triton_version", "write_results"]


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

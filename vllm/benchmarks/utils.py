"""The code version a benchmark run names (``git_sha``), shared by the serving benchmark and
the repository's benchmarks/ (through benchmarks/common/run_info.py).

``VLLM_RUN_SHA``, when set, is taken as it is: a machine that gets a copy of the working
tree may carry a stale ``.git`` (the GPU box's did), so whoever launches the run there
passes the commit it really is, e.g. ``VLLM_RUN_SHA=$(git rev-parse --short HEAD)`` in
the command line built on the development machine. Without it, a tree whose tracked
files differ from its HEAD is named ``<sha>+modified``; an installed package outside any
repository is ``unknown``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, check=True)
    return out.stdout.strip()


def git_sha(cwd: Path | None = None) -> str:
    """``VLLM_RUN_SHA`` when set; else HEAD's short sha, with ``+modified`` when tracked
    files differ from it (uncommitted changes, or a copied tree over a stale ``.git``).
    ``cwd`` defaults to the vllm package's folder: the checkout of an editable install."""
    given = os.environ.get("VLLM_RUN_SHA")
    if given:
        return given
    cwd = cwd or Path(__file__).resolve().parents[1]
    try:
        sha = _git(cwd, "rev-parse", "--short", "HEAD")
        changed = _git(cwd, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+modified" if changed else "")

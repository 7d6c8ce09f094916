"""The code version a benchmark ran: shared by the end-to-end and step benchmarks.

``VLLM_RUN_SHA``, when set, is taken as it is: a machine that gets a copy of the working
tree may carry a stale ``.git`` (the GPU box's did), so whoever launches the run there
passes the commit it really is, e.g. ``VLLM_RUN_SHA=$(git rev-parse --short HEAD)`` in
the command line built on the development machine.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_sha() -> str:
    given = os.environ.get("VLLM_RUN_SHA")
    if given:
        return given
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"

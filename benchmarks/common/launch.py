"""One benchmark running another in a fresh process: as a module of this package
(``python -m benchmarks.<family>.<name>``), with the repository root first on
``PYTHONPATH``, so that the child imports this tree's benchmarks and vllm whatever its
working directory (the parent may run from anywhere with ``-m``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_argv(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` (``benchmarks.engine.benchmark_throughput``)."""
    return [sys.executable, "-m", module, *args]


def tree_env(env: dict | None = None, **extra: str) -> dict:
    """``env`` (default: this process's) with the repository root first on PYTHONPATH, plus
    ``extra``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env

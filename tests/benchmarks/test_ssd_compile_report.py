"""ssd_compile_report: the SSD's three kernels compiled for sm_90 on the CPU, each timed, in
a child process (the report turns the interpreter off for its imports). It broke once
unnoticed when the op's launch gained an argument; this runs it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_three_kernels_compile_and_are_timed(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels.ssd_compile_report"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout, proc.stdout
    for name in ("_ssd_chunk_state_kernel", "_ssd_state_passing_kernel", "_ssd_chunk_scan_kernel"):
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(name)), None)
        assert line is not None, proc.stdout
        regs, seconds = re.search(r"regs +(\d+) .* compile +([\d.]+) s", line).groups()
        assert int(regs) > 0 and float(seconds) > 0, line

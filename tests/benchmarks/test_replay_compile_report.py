"""replay_compile_report: the replayed decode kernel compiled for sm_90 on the CPU (Triton's
own ptxas), in a child process (the report turns the interpreter off for its imports)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_loop_and_dot_flushes_compile_at_the_h200_fp32_tile(tmp_path):
    out = tmp_path / "replay.json"
    cmd = [sys.executable, "-m", "benchmarks.kernels.replay_compile_report", "--tiles",
           "32x32x1", "8x32x1", "--dtypes", "fp32", "--json", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["flush"], r["tile"]): r for r in data["rows"]}
    flushes = data["flushes"]  # the report's default list: every variant the asserts name
    assert set(rows) == {(f, t) for f in flushes for t in ("32x32x1", "8x32x1")}
    assert all(r["regs"] > 0 and r["stack"] >= 0 for r in rows.values())
    # The dot is taken at the H200 table's tile, not below tl.dot's 16 rows.
    assert rows["tf32x3", "32x32x1"]["dot"] and not rows["tf32x3", "8x32x1"]["dot"]
    assert rows["xsplit", "32x32x1"]["xsplit"] and not rows["xsplit", "8x32x1"]["xsplit"]
    assert not rows["loop", "32x32x1"]["dot"] and not rows["loop", "32x32x1"]["bc_pre"]
    for tile in ("32x32x1", "8x32x1"):  # a split step's first launch: no flush code
        split, whole = rows["loop/split", tile], rows["loop", tile]
        assert split["part"] == 1 and whole["part"] == 0
        assert split["stack"] == 0, (tile, split)
        # bc_pre: the step kernel (not the launch ahead) with BC_PRE, whole or split
        assert rows["xsplit/bc", tile]["bc_pre"] and rows["xsplit/bc", tile]["part"] == 0
        bc_split = rows["loop/split+bc", tile]
        assert bc_split["bc_pre"] and bc_split["part"] == 1 and bc_split["stack"] == 0
        fused = rows["loop/fused", tile]
        assert fused["fused"] and fused["part"] == 0 and not rows["loop", tile]["fused"]
    assert re.search(r"^fp32 tf32x3 +32x32x1 *: regs", proc.stdout, re.M), proc.stdout

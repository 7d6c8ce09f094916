"""conv1d_compile_report: the conv forward's variants compiled for sm_90 on the CPU (Triton's
own ptxas), in a child process (the report turns the interpreter off for its imports,
which must not leak into this session's kernels)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "vllm/model_executor/layers/mamba/ops/causal_conv1d_kernels.py"


def _report(tmp_path, name, *extra, path=""):
    out = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "benchmarks.kernels.conv1d_compile_report", "--dim", "256",
           "--configs", "tiles", "--json", str(out), *extra]  # fmt: skip
    search = os.pathsep.join(filter(None, [str(ROOT), path]))
    env = dict(os.environ, PYTHONPATH=search, TRITON_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600), out


def test_every_tiles_variant_compiles_and_another_kernels_module_is_used(tmp_path):
    proc, out = _report(tmp_path, "here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["variants"]
    # The engine's table: tiles at both tile lengths, nothing else asked for.
    assert sorted(r["BLOCK_T"] for r in rows) == [32, 64]
    assert {r["config"] for r in rows} == {"tiles"}
    assert all(r["compile_s"] > 0 and r["regs"] > 0 and r["ptx_kb"] > 0 for r in rows)
    assert "slowest: tiles" in proc.stdout
    # --kernels-module compiles that copy: one whose kernel fails a static assert fails.
    copy = tmp_path / "copy_conv_kernels.py"
    source = KERNELS.read_text()
    anchor = "    pid = tl.program_id(0).to(tl.int64)\n"
    assert source.count(anchor) == 1
    marker = '    tl.static_assert(False, "the copy under test")\n'
    copy.write_text(source.replace(anchor, anchor + marker))
    proc, _ = _report(tmp_path, "copy", "--kernels-module", copy.stem, path=str(tmp_path))
    assert proc.returncode != 0 and "the copy under test" in proc.stderr, proc.stderr[-3000:]

"""The fused-MoE GEMMs compiled for sm_90 on any machine (no GPU needed), in a fresh process
without the interpreter (``benchmarks.kernels.moe_compile_report``), at what the default
table picks for 256, 1024 and 4096 tokens of the benchmark's two shapes: what the table's
large-token entries rely on (docs/fused_moe.md, "Compile findings"). Each GEMM uses Hopper's
wgmma (BLOCK_M 16/32 compile to mma.sync), its K loop is pipelined through a ring of
``num_stages`` cp.async buffers, nothing spills, and the gate/up K step is one dot (one
HGMMA per 16 of K, gate and up interleaved in one tile, not two accumulators)."""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import require_cuda_tools, run_module

require_cuda_tools("ptxas", "nvdisasm")

SHAPES = "granite-4.0-h-small,nemotron-3-nano"


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("moe_compile") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_module("benchmarks.kernels.moe_compile_report", "--shapes", SHAPES,
                      "--tokens", "256,1024,4096", "--no-upstream", "--json", out, env=env,
                      capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_large_token_launch_is_recorded(rows):
    seen = {(r["shape"], r["tokens"], r["part"]) for r in rows}
    want = {(s, t, p) for s in SHAPES.split(",") for t in (256, 1024, 4096)
            for p in ("gate_up", "down")}  # fmt: skip
    assert seen == want
    assert not [r for r in rows if "error" in r]


def test_wgmma_pipelined_no_spills(rows):
    for r in rows:
        where = (r["shape"], r["tokens"], r["part"], r["tile"])
        assert r["tile"]["M"] >= 64, where  # below 64 rows Triton emits mma.sync
        assert r["dot"] == "wgmma", where
        assert r["spill_st"] == 0 and r["spill_ld"] == 0 and r["stack"] == 0, where
        assert r["cp_async"] > 0 and r["bufs"] == r["tile"]["s"] >= 3, where
        assert r["shared"] <= 227 * 1024, where


def test_one_dot_per_k_step(rows):
    """One 64xN HGMMA per warpgroup per 16 of K, and cp.async only as loads: the K loop
    holds no gathered-load or mask bookkeeping beyond upstream's (~90 SASS per trip)."""
    for r in rows:
        where = (r["shape"], r["tokens"], r["part"], r["tile"])
        assert r["mma"] == r["tile"]["K"] // 16, where
        assert r["ldg"] == 0 and 0 < r["loop"] <= 100, where

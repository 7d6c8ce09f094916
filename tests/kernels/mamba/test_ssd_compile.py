"""The SSD's three launches compiled for sm_90 on any machine (no GPU needed), in a fresh
process without the interpreter (``benchmarks.kernels.ssd_compile_compare``), at the H200
table's Codestral and Granite entries: what the table's compile-checked keys rely on
(docs/ssd.md, "Compile comparison"). Every launch takes Hopper's wgmma and spills nothing;
the chunk state with ``RELOAD_CS`` has no shuffles in its token loop (no per-trip cumsum)
and fewer instructions per trip than without it; the CB job with one dstate block loads only
B^T in its loop (C is hoisted); the chunk scan's source loops stay unpipelined (its register
operand wgmma must not be left in flight across the back edge)."""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import require_cuda_tools, run_module

require_cuda_tools("ptxas", "nvdisasm")


def _rows(tmp_path_factory, *sets: str) -> dict:
    out = tmp_path_factory.mktemp("ssd_compile") / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--shapes", "codestral,granite", "--no-upstream", "--json", out]
    if sets:
        argv += ["--set", *sets]
    proc = run_module("benchmarks.kernels.ssd_compile_compare", *argv, env=env,
                      capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {(r["shape"], r["kernel"]): r for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> dict:
    return _rows(tmp_path_factory)


@pytest.fixture(scope="module")
def no_reload(tmp_path_factory) -> dict:
    return _rows(tmp_path_factory, "chunk_state.RELOAD_CS=False")


def test_every_launch_compiles_to_wgmma_without_spills(table):
    kernels = ("chunk state", "passing+CB", "chunk scan")
    assert set(table) == {(s, k) for s in ("codestral", "granite") for k in kernels}
    for where, r in table.items():
        assert "error" not in r, (where, r.get("error"))
        assert r["dot"] == "wgmma", where
        assert r["spill_st"] == 0 and r["spill_ld"] == 0 and r["stack"] == 0, where
        assert r["shared"] <= 227 * 1024, where


def test_chunk_state_reload_cs_drops_the_per_trip_scan(table, no_reload):
    """The tables turn RELOAD_CS on (Codestral: NVIDIA_H200.json, Granite: default.json);
    off, each token-block trip recomputes softplus and a block cumsum (shuffles and
    barriers across the warps)."""
    for shape in ("codestral", "granite"):
        on, off = table[(shape, "chunk state")], no_reload[(shape, "chunk state")]
        assert "RELOAD_CS 1" in on["config"] and "RELOAD_CS 0" in off["config"], shape
        (loop_on,), (loop_off,) = on["loops"], off["loops"]
        assert loop_on["mma"] == loop_off["mma"] == 4, shape  # T 32: 2 k-steps, split x2
        assert loop_off["shfl"] > 0 and loop_on["shfl"] == 0, shape
        assert loop_on["bar"] < loop_off["bar"], shape
        assert loop_on["instrs"] < 0.9 * loop_off["instrs"], shape
        assert on["regs"] <= off["regs"], shape


def test_cb_job_hoists_c_with_one_dstate_block(table):
    """Codestral (dstate 128 = BLOCK_N): the CB loop loads only B^T (64 x 128 bf16: 8
    global loads per thread), one 64 x 64 x 128 dot (8 HGMMA); Granite (dstate 256) keeps
    both loads per dstate block."""
    cb = lambda r: max(r["loops"], key=lambda lp: lp["mma"])  # noqa: E731
    codestral, granite = (
        cb(table[("codestral", "passing+CB")]),
        cb(table[("granite", "passing+CB")]),
    )
    assert codestral["mma"] == 8 and granite["mma"] == 16
    assert codestral["gld"] == 8 and granite["gld"] == 32


def test_chunk_scan_source_loops_are_not_pipelined(table):
    """One stage: the local dot's weights come from registers (wgmma ``rs``); with more
    stages Triton 3.6 would leave it in flight across the back edge (docs/ssd.md)."""
    for shape in ("codestral", "granite"):
        r = table[(shape, "chunk scan")]
        assert r["rs"] > 0 and r["bufs"] == 1 and r["pend"] == 0, shape
        # Codestral (BLOCK_K 32 < BLOCK_M): off-diagonal and diagonal loops; Granite's
        # default.json entry (BLOCK_K = BLOCK_M 64) leaves one loop with a dot.
        assert len([lp for lp in r["loops"] if lp["mma"]]) == (2 if shape == "codestral" else 1)


@pytest.fixture(scope="module")
def one_head(tmp_path_factory) -> dict:
    return _rows(tmp_path_factory, "chunk_scan.HEADS=1", "chunk_scan.maxnreg=null")


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory) -> dict:
    return _rows(tmp_path_factory, "chunk_scan.HEADS=2", "chunk_scan.maxnreg=null")


def test_chunk_scan_two_heads_share_their_cb_loads(one_head, two_heads):
    """HEADS 2 (tune_ssd's variants): half the programs, each source trip two heads' dots
    (twice the HGMMA) from one CB block (fewer than twice the loads and instructions), still
    the register-operand wgmma, unpipelined and without spills (uncapped)."""
    one, two = one_head[("codestral", "chunk scan")], two_heads[("codestral", "chunk scan")]
    assert "HEADS 1" in one["config"] and "HEADS 2" in two["config"]
    assert two["programs"] * 2 == one["programs"]
    assert two["dot"] == "wgmma" and two["rs"] > 0 and two["bufs"] == 1 and two["pend"] == 0
    assert two["stack"] == 0 and two["spill_st"] == 0
    off_one, off_two = one["loops"][0], two["loops"][0]  # the off-diagonal source loop
    assert off_two["mma"] == 2 * off_one["mma"]
    assert off_one["gld"] < off_two["gld"] < 2 * off_one["gld"]
    assert off_two["instrs"] < 2 * off_one["instrs"]

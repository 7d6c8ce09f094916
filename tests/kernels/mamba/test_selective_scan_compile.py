"""Mamba1's selective-scan kernels compiled for sm_90 on any machine (no GPU needed), in a
fresh process without the interpreter (``selective_scan_compile``): every variant compiles;
the scan loop keeps each channel's state in one thread (no shuffle, no barrier) with one
ex2 per state column plus softplus and the gate per token, in at most 230 SASS instructions
per token; and the latency knobs do what default.json's choice rests on: PREFETCH issues
all of a token's row loads before the first wait, UNROLL 2 issues more loads ahead than
the plain loop in fewer instructions per token, without spilling."""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import run_module

pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend (ptxas)")

CHUNK_VARIANTS = (
    "chunk final=False", "chunk final=True", "chunk final=True prefetch",
    "chunk final=False prefetch", "chunk final=False unroll=2", "chunk final=True unroll=2",
    "chunk final=True prefetch unroll=2", "chunk final=True unroll=4", "chunk bare bf16-pool",
)  # fmt: skip


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_module("tests.kernels.mamba.selective_scan_compile", env=env,
                      capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {r["variant"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(out) == {*CHUNK_VARIANTS, "state passing", "update", "update bare"}, proc.stdout
    return out


def test_kernels_compile_for_sm90_without_layout_round_trips(rows):
    for name in (*CHUNK_VARIANTS, "state passing"):
        assert rows[name]["shfl"] == 0 and rows[name]["bar"] == 0, rows[name]
    # dstate=16: 16 decays, then softplus's exp and the gate's sigmoid, once per channel and
    # token; the rescan kernel has one such body per token of a group, plus the remainder
    # loop's when UNROLL > 1.
    for name in ("chunk final=True", "chunk final=True unroll=2", "chunk final=True unroll=4"):
        u = rows[name]["unroll"]
        assert rows[name]["ex2"] <= 18 * (u + (u > 1)), rows[name]
    final = rows["chunk final=True"]
    if "loop_instrs" in final:  # the SASS of one token (217 with Triton 3.6's ptxas)
        assert 0 < final["loop_instrs"] <= 230, final


def test_the_latency_knobs_in_the_sass(rows):
    """What default.json's knobs rest on (its meta says it in words): the loop's row loads,
    11 per token (u, delta, z, and B, C as four 16-byte loads each), all issued before
    the first wait with PREFETCH; UNROLL 2 issues more before its first wait than the plain
    loop, in fewer instructions per token; neither spills."""
    final = rows["chunk final=True"]
    if "loop_ldg" not in final:
        pytest.skip("Triton ships no nvdisasm/cuobjdump here: no SASS to read")
    for name in CHUNK_VARIANTS[:-1]:
        r = rows[name]
        assert r["loop_ldg"] == 11 * r["unroll"], r
        assert r["loop_mufu"] == 20 * r["unroll"], r  # 16 decays, softplus, gate: per token
        assert r["stack"] == 0, r
    for name in ("chunk final=True prefetch", "chunk final=False prefetch",
                 "chunk final=True prefetch unroll=2"):  # fmt: skip
        assert rows[name]["ldg_ahead"] == rows[name]["loop_ldg"], rows[name]
    two = rows["chunk final=True unroll=2"]
    assert two["ldg_ahead"] > final["ldg_ahead"], (two, final)
    assert two["loop_instrs"] / 2 < final["loop_instrs"], (two, final)
    # The plain rescan fits 8 programs of 2 warps per SM (the table's target of 1056 on 132
    # SMs); its PREFETCH variant, the default, too: at most 128 registers.
    assert rows["chunk final=True prefetch"]["regs"] <= 128, rows["chunk final=True prefetch"]


def test_the_compile_module_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_module("tests.kernels.mamba.selective_scan_compile", env=env,
                      capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "TRITON_INTERPRET unset" in proc.stderr

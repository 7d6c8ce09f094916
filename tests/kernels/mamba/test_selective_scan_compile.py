"""Mamba1's selective-scan kernels compiled for sm_90 on any machine (no GPU needed), in a
fresh process without the interpreter (``selective_scan_compile``): every variant compiles,
and the scan loop keeps each channel's state in one thread (no shuffle, no barrier per
token) with one ex2 per state column plus softplus and the gate, in at most 230 SASS
instructions per token."""

from __future__ import annotations

import json
import os

import pytest

from tests.utils import run_module

pytest.importorskip("triton.backends.nvidia", reason="needs Triton's NVIDIA backend (ptxas)")


def test_kernels_compile_for_sm90_without_layout_round_trips():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_module("tests.kernels.mamba.selective_scan_compile", env=env,
                      capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["variant"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(rows) == 6, proc.stdout
    for name in ("chunk final=False", "chunk final=True", "chunk bare bf16-pool", "state passing"):
        assert rows[name]["shfl"] == 0 and rows[name]["bar"] == 0, rows[name]
    # dstate=16: 16 decays, then softplus's exp and the gate's sigmoid, once per channel.
    final = rows["chunk final=True"]
    assert final["ex2"] <= 18, final
    if "loop_instrs" in final:  # the SASS of one token (217 with Triton 3.6's ptxas)
        assert 0 < final["loop_instrs"] <= 230, final


def test_the_compile_module_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_module("tests.kernels.mamba.selective_scan_compile", env=env,
                      capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "TRITON_INTERPRET unset" in proc.stderr

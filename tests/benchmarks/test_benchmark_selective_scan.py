"""benchmarks/kernels/benchmark_selective_scan.py on the CPU (--smoke, Triton interpreter):
the bytes and bounds at falcon-mamba-7b's shape, and a smoke run whose providers (ours,
prefill chunked and not, and the decode update; transformers' PyTorch scan) pass their
checks against the fp32 reference."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks.kernels import benchmark_selective_scan as bench


def test_bytes_and_bounds_at_the_falcon_shape(monkeypatch):
    """docs/selective_scan.md's figures: 537 MB + B, C and one fp32 state line in and out
    at 1 x 8192; SFU 289 us; issue 436 us for one pass, ~1.67 passes with 993-token chunks."""
    for name, value in (("DIM", 8192), ("DSTATE", 16), ("ACT", torch.bfloat16)):
        monkeypatch.setattr(bench, name, value)  # whatever a smoke run left
    case = bench.Case.__new__(bench.Case)
    case.seqs, case.length, case.state_dtype = 1, 8192, torch.float32
    want = 4 * 8192 * 8192 * 2 + 2 * 8192 * 16 * 2 + 2 * 8192 * 16 * 4
    assert case.nbytes() == want
    b = bench.bounds(case)
    assert b["chunk_len"] == 993
    assert b["sfu_us"] == pytest.approx(289, abs=1)
    assert b["issue_us"] / b["passes"] == pytest.approx(436, abs=1)
    assert b["passes"] == pytest.approx(1 + (8192 - 993) / 8192 * 165 / 217)
    case.seqs, case.length = 16, 512  # one chunk per sequence: one pass
    assert bench.bounds(case)["passes"] == 1


def test_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmark_selective_scan.py"])
    for name in ("DIM", "DSTATE", "ACT"):  # --smoke rebinds them: restored after the test
        monkeypatch.setattr(bench, name, getattr(bench, name))
    rows = bench.main(["--smoke", "--out", str(tmp_path)])
    ops = [(r["op"], r["seqs"], r["tokens"], r["state_dtype"]) for r in rows]
    assert ops == [
        (op, s, t, d)
        for d in ("float32", "bfloat16")
        for op, s, t in (("prefill", 1, 70), ("prefill", 2, 8), ("decode", 1, 1), ("decode", 3, 3))
    ]
    for r in rows:
        assert r["ours"]["ok"] and r["ours"]["us"] > 0, r
        if r["op"] == "prefill":
            assert r["hf"].get("ok", "skipped" in r["hf"]), r["hf"]
    assert bench.failed(rows) == []
    assert rows[0]["passes"] > 1  # 1 x 70 is cut into two chunks: the rescan path ran
    saved = json.loads((tmp_path / "selective_scan_bench.json").read_text())
    assert len(saved["rows"]) == len(rows) and saved["meta"]["dim"] == 8
    # transformers (the tests' oracle) is installed: its PyTorch scan ran, not a skip
    hf = "transformers.models.falcon_mamba.modeling_falcon_mamba.mamba_selective_scan"
    assert saved["meta"]["hf"] == hf
    assert all(r["hf"]["ok"] for r in rows if r["op"] == "prefill")
    assert "FAIL" not in (tmp_path / "selective_scan_bench.md").read_text()

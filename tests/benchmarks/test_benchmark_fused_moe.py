"""benchmarks/kernels/benchmark_fused_moe.py on the CPU (--smoke, Triton interpreter): the
work counted per call, and a smoke run whose providers pass their checks against the fp32
reference (upstream vLLM 0.33.0's kernel where ``upstream_vllm033`` imports, else skipped
with the reason)."""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.kernels import benchmark_fused_moe as bench


def test_work_counts_used_experts_once():
    case = bench.Case((8, 4, 6, 2, True), 3, torch.float32, "cpu")
    case.ids = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.int32)  # experts 0, 1
    nbytes, flops = case.work()
    # Two experts' w13 (12, 8) and w2 (8, 6), x read and out written.
    assert nbytes == 2 * (12 * 8 + 8 * 6) * 4 + 2 * 3 * 8 * 4
    assert flops == 2 * 6 * (12 + 6) * 8


def test_smoke_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmark_fused_moe.py"])
    rows = bench.main(["--smoke", "--out", str(tmp_path)])
    assert [(r["shape"], r["tokens"]) for r in rows] == [
        (s, t) for s in bench.SMOKE_SHAPES for t in (1, 5)
    ]
    up, reason = bench.upstream_module()
    for r in rows:
        for name in ("ours", "torch"):
            assert r[name]["ok"] and r[name]["us"] > 0, (name, r[name])
        if up is None:
            assert r["upstream"] == {"skipped": reason} and reason.startswith("skipped: not found")
        else:
            assert r["upstream"]["ok"], r["upstream"]
    assert bench.failed(rows) == []
    rows[0]["ours"]["ok"] = False  # a failed check is named (the run then exits 1)
    assert bench.failed(rows) == [f"ours at {dict(shape=rows[0]['shape'], tokens=1)}"]
    saved = json.loads((tmp_path / "fused_moe_bench.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert "FAIL" not in (tmp_path / "fused_moe_bench.md").read_text()

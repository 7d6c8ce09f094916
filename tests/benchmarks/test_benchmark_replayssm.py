"""benchmarks/kernels/benchmark_replayssm.py on the CPU (--smoke, Triton interpreter): the
bytes a step moves, and a smoke run whose providers pass their checks (upstream's where
``upstream_vllm033`` imports, skipped otherwise)."""

from __future__ import annotations

import sys

import torch

from benchmarks.kernels import benchmark_replayssm as bench


def test_step_bytes_and_smoke_run(tmp_path, monkeypatch):
    # Codestral layer, fp32 state, batch 1: 4 MiB read and written every step; replayed,
    # read every step, written every 16th, the ring's mean 7.5 entries read and 15/16 written.
    state, io = 128 * 64 * 128 * 4, 2 * 128 * 64 * 2 + 2 * 8 * 128 * 2 + 128 * 2
    assert bench.step_bytes(1, torch.float32, None) == 2 * state + io
    entry = 128 * 64 * 2 + 8 * 128 * 2 + 128 * 4
    replayed = state * 17 / 16 + entry * (7.5 + 15 / 16) + io
    assert bench.step_bytes(1, torch.float32, 16) == replayed
    monkeypatch.setattr(sys, "argv", ["benchmark_replayssm.py"])
    args = ["--smoke", "--batches", "2", "--buffer-len", "3", "--state-dtypes", "float32"]
    rows = bench.main([*args, "--out", str(tmp_path)])
    (row,) = rows
    for name in bench.PROVIDERS:
        assert row[name].get("ok", "skipped" in row[name]), (name, row[name])
    assert (tmp_path / "replayssm.json").is_file()

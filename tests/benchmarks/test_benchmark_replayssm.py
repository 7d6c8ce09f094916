"""benchmarks/kernels/benchmark_replayssm.py on the CPU (--smoke, Triton interpreter): the
bytes a step moves, and a smoke run whose providers pass their checks (upstream's where
``upstream_vllm033`` imports, skipped otherwise)."""

from __future__ import annotations

import json
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


# The flushes the tune tries after the tiles: the dots, bc_pre with the loop, the dots and a
# split step, then fuse_flush with the loop and the dots: (flush, split_flush, bc_pre, fused).
VARIANTS = [("tf32x3", None, None, None), ("xsplit", None, None, None),
            (None, None, True, None), ("tf32x3", None, True, None), ("xsplit", None, True, None),
            (None, True, True, None), (None, None, None, True), ("tf32x3", None, None, True),
            ("xsplit", None, None, True)]  # fmt: skip


def _variant(t: dict) -> tuple:
    return t.get("flush"), t.get("split_flush"), t.get("bc_pre"), t.get("fuse_flush")


def test_tune_sweeps_the_dstate_tile(tmp_path, monkeypatch):
    """--tune times each (BLOCK_P, BLOCK_N, num_warps) as given (it once forced BLOCK_N 128,
    so the table's 32/64 tiles were never measured), then the fastest's other flushes (a
    tl.dot, bc_pre, split in two launches), and writes the fastest exact one, BLOCK_N and
    flush too."""
    monkeypatch.setattr(sys, "argv", ["benchmark_replayssm.py"])
    monkeypatch.setattr(bench, "TUNE", ((16, 128, 1), (16, 32, 1), (16, 64, 1)))
    real, seen = bench.replay.launch_config, []

    def fake_time(name, case, up):  # BLOCK_N 32 is made the fastest, then its dot flush
        cfg = bench.replay.launch_config(1, 64, 128, torch.float32)
        block_n = cfg["BLOCK_N"]
        seen.append((name, block_n))
        if cfg.get("flush") == "tf32x3":
            return [0.5] * 3
        return [1.0 if block_n == 32 else 2.0] * 3

    monkeypatch.setattr(bench, "time_provider", fake_time)
    args = ["--smoke", "--batches", "1", "--buffer-len", "3", "--state-dtypes", "float32"]
    (row,) = bench.main([*args, "--tune", "--out", str(tmp_path)])
    assert [t["BLOCK_N"] for t in row["tune"]] == [128, 32, 64] + [32] * len(VARIANTS)
    assert [_variant(t) for t in row["tune"][3:]] == VARIANTS
    assert all(t["exact"] for t in row["tune"][3:])  # checked against the loop's states
    assert seen[:3] == [("ours_replay", 128), ("ours_replay", 32), ("ours_replay", 64)]
    assert ("ours_replay", 32) in seen[4:]  # the providers then run the chosen entry
    (table,) = [p for p in tmp_path.glob("*.json") if p.name != "replayssm.json"]
    (entry,) = json.loads(table.read_text())["entries"].values()
    assert entry == {"BLOCK_P": 16, "BLOCK_N": 32, "num_warps": 1, "flush": "tf32x3"}
    assert bench.replay.launch_config is real


def test_tune_flush_keeps_the_table_tiles(tmp_path, monkeypatch):
    """--tune-flush sweeps no tiles: it starts from the table's entry with its flush dropped
    (the loop), then the other flushes and bc_pre on those tiles; bc_pre's split step wins."""
    monkeypatch.setattr(sys, "argv", ["benchmark_replayssm.py"])
    table_entry = {"BLOCK_P": 8, "BLOCK_N": 16, "num_warps": 1, "flush": "tf32x3"}
    monkeypatch.setattr(bench.replay, "launch_config", lambda *a: dict(table_entry))

    def fake_time(name, case, up):
        cfg = bench.replay.launch_config(1, 64, 128, torch.float32)
        return [0.5 if cfg.get("split_flush") and cfg.get("bc_pre") else 1.0] * 3

    monkeypatch.setattr(bench, "time_provider", fake_time)
    args = ["--smoke", "--batches", "1", "--buffer-len", "3", "--state-dtypes", "float32"]
    (row,) = bench.main([*args, "--tune-flush", "--out", str(tmp_path)])
    tiles = {"BLOCK_P": 8, "BLOCK_N": 16, "num_warps": 1}
    assert row["tune"][0] == {**tiles, "us": 1.0}  # the loop on the table's tiles, alone
    assert [_variant(t) for t in row["tune"][1:]] == VARIANTS
    (table,) = [p for p in tmp_path.glob("*.json") if p.name != "replayssm.json"]
    (entry,) = json.loads(table.read_text())["entries"].values()
    assert entry == {**tiles, "bc_pre": True, "split_flush": True}

"""benchmarks/kernels/benchmark_conv_host_cost.py on the CPU (--smoke, Triton interpreter):
the reference check runs the real kernels, the timed loops stub the launches, and the JSON
carries every case, the targets, the breakdown of the host path and the profile."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import benchmark_conv_host_cost as bench


def _check_stats(stats):
    assert set(stats) == {"median", "p20", "p80"}
    assert 0 < stats["p20"] <= stats["median"] <= stats["p80"]


def test_smoke_run_writes_every_key(tmp_path):
    out, md = tmp_path / "host.json", tmp_path / "host.md"
    res = bench.main(["--smoke", "--profile", "--calls", "5", "--reps", "2", "--out", str(out),
                      "--md", str(md)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["markdown"] == md.read_text() == res["markdown"]
    assert saved["checked"] is True
    env = saved["environment"]
    assert set(env) >= {"device", "torch", "triton", "launches", "dtype", "dim", "git_sha",
                        "command"}  # fmt: skip
    if not torch.cuda.is_available():
        assert env["launches"].startswith("stubbed")
    assert saved["targets_us"] == {"update": 15.0, "fn_meta": 20.0, "metadata": 30.0}
    expected = {"update_B1", "update_B4", "fn_meta_5+3", "fn_nometa_5+3", "metadata_5+3",
                "metadata_decode4"}  # fmt: skip
    assert expected <= set(saved["cases"])
    for name, row in saved["cases"].items():
        _check_stats(row["loop_us"])
        _check_stats(row["enqueue_us"])
        assert row["calls"] == 5 and row["reps"] == 2
        kind = name.split("_B")[0] if name.startswith("update") else name.rsplit("_", 1)[0]
        if kind in ("update", "fn_meta", "metadata"):
            assert row["target_us"] == saved["targets_us"][kind]
            assert row["met"] == (row["loop_us"]["median"] <= row["target_us"])
    bd = saved["breakdown"]
    assert bd["available"] is True
    for case in ("update_B1", "fn_meta_5+3", "fn_nometa_5+3"):
        pieces = bd["cases"][case]
        assert {"plan lookup (checks)", "output allocation", "launch", "whole call"} <= set(pieces)
        assert all(v > 0 for v in pieces.values())
    assert "step checks and config" in bd["cases"]["fn_meta_5+3"]
    prof = saved["profile"]["update_B1"]
    assert prof and all(r["own_us_per_call"] >= 0 for r in prof)
    assert "| update_B1 |" in saved["markdown"] and "Pieces of the host path" in saved["markdown"]


def test_a_wrong_result_stops_the_run(monkeypatch, tmp_path, capsys):
    real = bench.causal_conv1d_update

    def off_by_one(*args, **kwargs):
        return real(*args, **kwargs) + 1.0

    monkeypatch.setattr(bench, "causal_conv1d_update", off_by_one)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--smoke", "--calls", "2", "--reps", "1", "--out", str(tmp_path / "x.json")])
    assert stop.value.code == 1
    assert "update_B1: outputs differ" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()


def test_skip_check_times_stubbed_launches_only():
    if torch.cuda.is_available():
        with pytest.raises(SystemExit):  # real launches are timed only after the check
            bench.main(["--smoke", "--skip-check"])
    res = bench.main(["--smoke", "--skip-check", "--stub-launch", "--calls", "2", "--reps", "1"])
    assert res["checked"] is False
    assert res["environment"]["launches"].startswith("stubbed")

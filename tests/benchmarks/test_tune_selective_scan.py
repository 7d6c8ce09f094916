"""benchmarks/kernels/tune_selective_scan.py on the CPU (--smoke, Triton interpreter): the
sweep checks every candidate against the fp32 reference, and the table it writes loads
through the op's own lookup (``selective_scan_host.scan_config``), both keys."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks.kernels import benchmark_selective_scan as bench
from benchmarks.kernels import tune_selective_scan as tune
from vllm.model_executor.layers.mamba.ops import selective_scan_host as host
from vllm.triton_utils import configs


@pytest.fixture
def smoke_globals(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["tune_selective_scan.py"])
    for name in ("DIM", "DSTATE", "ACT"):  # --smoke rebinds them: restored after the test
        monkeypatch.setattr(bench, name, getattr(bench, name))


def test_the_candidates_cover_the_knobs_the_compile_keeps():
    base = host.scan_config(8192, 16, torch.bfloat16)
    cands = tune.candidates(base, smoke=False)
    assert len(cands) == 3 * 4 * 5 * 5
    layouts = {(c["chunk"]["BLOCK_D"], c["chunk"]["num_warps"]) for c in cands}
    assert layouts == {(32, 1), (64, 2), (128, 4)}  # one channel per thread
    assert {c["rescan"]["UNROLL"] for c in cands} == {1, 2, 4}
    assert {c["chunk"]["UNROLL"] for c in cands} == {1, 2}
    assert {c["chunk"].get("maxnreg") for c in cands} == {None, 128}  # launch 1's register cap
    assert not any("maxnreg" in c["rescan"] for c in cands)  # the rescan takes knobs only
    for c in cands:  # every one is a table entry the op accepts
        host.chunk_options(c, 8192, 16, final=True)
    assert tune.UPDATE[0] == dict(BLOCK_D=32, num_warps=1) and len(tune.UPDATE) == 12


def test_smoke_writes_a_table_the_op_reads(tmp_path, smoke_globals, monkeypatch):
    path = tmp_path / "default.json"  # the name the lookup reads without CUDA
    summary = tune.main(["--smoke", "--write", str(path)])
    winner = summary["winner"]
    assert all(c["ok"] for c in summary["prefill"][0]["cases"].values())
    assert all(c["ok"] for c in summary["update"][0]["cases"].values())
    assert len(summary["prefill"][0]["cases"]) == 4 and len(summary["update"][0]["cases"]) == 4
    capped = [p for p in summary["all_prefill"] if p["entry"]["chunk"].get("maxnreg") == 128]
    assert capped and all(c["ok"] for p in capped for c in p["cases"].values())
    monkeypatch.setattr(host, "CONFIG_DIR", tmp_path)
    configs._read.cache_clear()
    try:
        assert host.scan_config(8, 4, torch.float16) == winner
        assert host.scan_config(16, 4, torch.float16) == winner  # the dtype-only fallback
        host.chunk_options(winner, 8, 4, final=True)
    finally:
        configs._read.cache_clear()
    meta = json.loads(path.read_text())["meta"]
    assert meta["command"].startswith("python -m benchmarks.kernels.tune_selective_scan")
    for field in ("commit", "device", "date_utc", "winner_us", "runner_up", "default_json_us",
                  "update_us"):  # fmt: skip
        assert meta[field], field
    assert set(meta["winner_us"]) == {"1x70_float32", "2x8_float32", "1x70_bfloat16",
                                      "2x8_bfloat16"}  # fmt: skip


def test_no_candidate_is_taken_when_none_passes_its_checks(smoke_globals, monkeypatch):
    monkeypatch.setattr(bench, "TOL", dict.fromkeys(bench.TOL, 0.0))
    monkeypatch.setattr(tune, "candidates", lambda base, smoke: [base])
    with pytest.raises(SystemExit, match="no candidate passed its checks"):
        tune.main(["--smoke"])

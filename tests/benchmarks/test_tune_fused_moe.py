"""benchmarks/kernels/tune_fused_moe.py on the CPU (--smoke, Triton interpreter): the table
it writes loads through ``launch_config`` entry for entry, with its meta; the winner is never
slower than the table it started from; a candidate failing its check is never written; the
candidate lists keep to what the compile findings allow; bad arguments name themselves."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.kernels import tune_fused_moe as tune
from vllm.model_executor.layers.fused_moe import fused_moe as fm
from vllm.triton_utils import configs


def _load_through_op(monkeypatch, folder, shape, tokens) -> dict:
    monkeypatch.setattr(fm, "CONFIG_DIR", folder)
    fm._config.cache_clear()
    configs._read.cache_clear()
    hidden, experts, inter, _, _ = shape
    return fm.launch_config(tokens, experts, hidden, inter, torch.float32)


def test_smoke_writes_a_table_the_op_reads(tmp_path, monkeypatch):
    results = tune.main(["--smoke", "--out", str(tmp_path)])
    try:
        path = tmp_path / f"{configs.device_file_name()}.json"
        table = json.loads(path.read_text())
        assert {"command", "commit", "device", "date_utc", "triton"} <= set(table["meta"])
        assert table["meta"]["command"].endswith(f"--smoke --out {tmp_path}")
        assert len(table["entries"]) == len(tune.SMOKE_SHAPES) * 2
        for name, rows in results.items():
            shape = tune.SMOKE_SHAPES[name]
            assert [r["tokens"] for r in rows] == [1, 16]
            for r in rows:
                assert r["us"] <= r["default_us"] and math.isfinite(r["us"])
                assert _load_through_op(monkeypatch, tmp_path, shape, r["tokens"]) == r["entry"]
    finally:
        fm._config.cache_clear()
        configs._read.cache_clear()


def test_a_failing_candidate_is_never_taken(tmp_path, monkeypatch):
    real = tune.Sweep.check

    def check(self, tokens, entry):  # every candidate but the table's own entry "fails"
        return real(self, tokens, entry) if entry is None else float("nan")

    monkeypatch.setattr(tune.Sweep, "check", check)
    results = tune.main(["--smoke", "--shapes", "smoke-gated", "--out", str(tmp_path)])
    for r in results["smoke-gated"]:
        assert "gate_up" not in r["entry"] and r["us"] == r["default_us"], r


def test_candidate_lists_follow_the_compile_findings():
    for bucket in tune.BUCKETS:
        assert tune.BLOCK_M[bucket] and tune.GATE_UP[bucket] and tune.DOWN[bucket]
        if bucket >= 1024:  # wgmma needs 64 rows; mma.sync variants only as 256's foil
            assert min(tune.BLOCK_M[bucket]) >= 64
    for tile in tune._LARGE_UP + tune._LARGE_DOWN:
        assert tile["BLOCK_K"] >= 64 and tile["num_stages"] >= 3
    # The sweep's time budget: at most 14 timed tile candidates per case, then the grid
    # order of each GEMM (GROUPS less the one the entry has) and the unsorted toggle.
    for b in tune.BUCKETS:
        assert len(tune.BLOCK_M[b]) * len(tune.GATE_UP[b]) + len(tune.DOWN[b]) <= 14
    assert 1 in tune.GROUPS and 2 * (len(tune.GROUPS) - 1) + 1 + 1 <= 6
    for bucket, wholes in tune.WHOLE.items():  # whole entries: wgmma tiles, two a case
        assert bucket in tune.BUCKETS and len(wholes) <= 2
        for block_m, up, down in wholes:
            assert block_m >= 64 and min(up["BLOCK_K"], down["BLOCK_K"]) >= 64


def test_a_whole_entry_that_does_not_fit_is_skipped(tmp_path, monkeypatch):
    from triton.runtime.errors import OutOfResources

    [(block_m, up, down)] = tune.SMOKE_WHOLE[16]
    real = tune.Sweep.check

    def check(self, tokens, entry):  # the whole entry asks for more shared memory than exists
        if entry and entry["BLOCK_M"] == block_m and entry["gate_up"] == up:
            raise OutOfResources(327680, 232448, "shared memory")
        return real(self, tokens, entry)

    monkeypatch.setattr(tune.Sweep, "check", check)
    results = tune.main(["--smoke", "--shapes", "smoke-relu2", "--out", str(tmp_path)])
    row = results["smoke-relu2"][1]
    assert row["tokens"] == 16 and math.isfinite(row["us"])
    assert row["entry"].get("gate_up") != up


def test_whole_entries_are_timed(tmp_path, monkeypatch):
    seen = []
    real = tune.Sweep.check

    def check(self, tokens, entry):
        seen.append((tokens, entry))
        return real(self, tokens, entry)

    monkeypatch.setattr(tune.Sweep, "check", check)
    tune.main(["--smoke", "--shapes", "smoke-relu2", "--out", str(tmp_path)])
    [(block_m, up, down)] = tune.SMOKE_WHOLE[16]
    whole = [e for t, e in seen if t == 16 and e and e["BLOCK_M"] == block_m
             and e["gate_up"] == up and e["down"] == down]  # fmt: skip
    assert whole, "the whole-entry stage timed nothing"
    assert not [e for t, e in seen if t == 1 and e and e["gate_up"] == up and e["down"] == down
                and e["BLOCK_M"] == block_m]  # fmt: skip


def test_order_and_unsorted_candidates():
    base = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3,
            "down": {"BLOCK_N": 128, "GROUP_SIZE_M": 8}}  # fmt: skip
    ups = tune.order_candidates(base, "gate_up", (1, 8, 1024))
    assert [tune.resolved(c, "gate_up")["GROUP_SIZE_M"] for c in ups] == [8, 1024]
    downs = tune.order_candidates(base, "down", (1, 8, 1024))
    assert [c["down"] for c in downs] == [{"BLOCK_N": 128, "GROUP_SIZE_M": g} for g in (1, 1024)]
    assert "gate_up" not in base and base["down"]["GROUP_SIZE_M"] == 8  # copies
    [masked] = tune.mask_candidates(base)  # BLOCK_M 16: rows masked by default
    assert masked["gate_up"]["MASK_ROWS"] is False and masked["down"]["MASK_ROWS"] is False
    assert tune.mask_candidates(masked)[0]["down"]["MASK_ROWS"] is True
    nano = tune.SHAPES["nemotron-3-nano"]  # 128 experts, top 6: unsorted up to 32 pairs
    [off] = tune.unsorted_candidates(base, 1, nano)
    assert off["align"] == {"max_unsorted_pairs": 0}
    [on] = tune.unsorted_candidates(off, 1, nano)
    assert on["align"] == {"max_unsorted_pairs": 6}
    assert tune.unsorted_candidates(base, 16, nano)[0]["align"] == {"max_unsorted_pairs": 96}
    assert tune.unsorted_candidates(base, 64, nano) == []  # 384 pairs > 128 experts


def test_candidate_keeps_part_dicts_and_resolves_the_base():
    base = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3,
            "down": {"BLOCK_N": 128}, "align": {"num_warps": 8}}  # fmt: skip
    assert tune.resolved(base, "down") == dict(BLOCK_N=128, BLOCK_K=64, num_warps=4,
                                               num_stages=3)  # fmt: skip
    up = tune._tile(32, 128, 4, 4)
    c = tune.candidate(base, 64, up, tune.resolved(base, "down"))
    assert c["BLOCK_M"] == 64 and c["gate_up"] == up and c["align"] == {"num_warps": 8}
    assert tune.resolved(c, "gate_up") == up


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--smoke", "--shapes", "nope", "--out", "x"], "--shapes: unknown"),
        (["--smoke"], "--smoke needs --out"),
    ],
)
def test_bad_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        tune.main(argv)

"""benchmarks/kernels/conv1d_bounds.py on the CPU (--smoke, Triton interpreter): every case
and key in the JSON, every check passed, and the floors' kernels doing real work (the
copies' outputs are their inputs, element for element, the halo loads are live)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.kernels import benchmark_causal_conv1d
from benchmarks.kernels import conv1d_bounds as bench


def test_smoke_run_writes_every_key(tmp_path):
    out, md = tmp_path / "bounds.json", tmp_path / "bounds.md"
    res = bench.main(["--smoke", "--reps", "3", "--out", str(out), "--md", str(md)])
    saved = json.loads(out.read_text())
    assert saved["markdown"] == md.read_text() == res["markdown"]
    assert set(saved["environment"]) >= {"gpu", "torch", "triton", "git_sha", "command",
                                         "copy_gbps", "smoke"}  # fmt: skip
    assert saved["environment"]["smoke"] is True
    assert saved["environment"]["command"] == (
        f"python benchmarks/kernels/conv1d_bounds.py --smoke --reps 3 --out {out} --md {md}"
    )
    assert saved["checks_passed"] is True
    cases = saved["cases"]
    assert list(cases) == list(bench.SMOKE_CASES)
    for name, case in cases.items():
        assert set(case) >= {"kind", "target_us", "bytes", "config", "grid", "programs", "sms",
                             "programs_per_sm", "timer", "kernels", "checks", "times",
                             "bandwidth_floor_us", "excess_us", "tightest_floor",
                             "variant_options"}  # fmt: skip
        want = {"op", "torch_copy", "grid_copy", "no_metadata", "empty"}
        if case["kind"] == "decode":
            want |= {"op_direct", "chain_index", "chain_index_state"}
        assert set(case["times"]) == want
        assert set(case["checks"]) == want - {"op", "torch_copy", "empty"}
        assert all(case["checks"].values()), (name, case["checks"])
        assert case["programs"] > 0 and f"## {name} " in saved["markdown"]
        if not torch.cuda.is_available():  # no timing claims on the CPU
            assert all(t == {"cold": None, "graph": None} for t in case["times"].values())
    cfg = cases["mixed_64+31"]["config"]
    assert cfg["name"] == "many_heads" and cfg["HEAD_S"] == 4
    assert cases["prefill_256x2"]["config"]["name"] == "small_step"


@pytest.mark.parametrize("lens", [[128, 128], [64] + [1] * 31])
def test_grid_copy_outputs_are_its_inputs(lens):
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = bench.Step("prefill", lens, len(lens) > 2, 64, dtype, device, 64, 1)
    out = torch.full((st.tokens, st.dim), float("nan"), dtype=dtype, device=device).t()
    pool = st.local_pool()
    st.grid_copy(pool, out)
    assert torch.equal(out, st.x)  # every element stored, each the row it loaded
    op_pool = st.pool.clone()
    st.op(op_pool)
    assert torch.equal(pool[: st.batch], op_pool[st.idx.long()])  # heads: the op's lines
    st.grid_copy(st.local_pool(), out, sel=1)  # the halo rows were loaded: W-1 rows back
    assert torch.equal(out[:, bench.W - 1 :], st.x[:, : 1 - bench.W])


def test_decode_copy_and_chains_move_the_data():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = bench.Step("decode", [1, 1, 1], True, 64, torch.float32, device, 16, 2)
    out = torch.full((st.batch, st.dim), float("nan"), device=device)
    pool = st.local_pool()
    st.decode_copy(pool, out)
    assert torch.equal(out, st.x.t())
    want = torch.cat([st.pool[st.idx.long(), :, 1:], st.x.t()[:, :, None]], dim=2)
    assert torch.equal(pool[: st.batch], want)
    st.chain(2, out)
    assert torch.equal(out, st.pool[st.idx.long(), :, 0])
    lines = torch.zeros(st.batch, st.dim, dtype=torch.int32, device=device)
    st.chain(1, lines)
    assert torch.equal(lines, st.idx[:, None].expand(-1, st.dim))


def test_bytes_are_the_main_benchmarks():
    for kind, lens, init, _ in bench.CASES.values():
        case = benchmark_causal_conv1d.Case(kind, 8448, lens, [init] * len(lens))
        assert bench.bytes_moved(lens, init, 8448, 2) == case.bytes_moved()

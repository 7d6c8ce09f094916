"""benchmarks/kernels/benchmark_ssd.py on the CPU (--smoke, Triton interpreter): the work
counts, the fp32 reference against our PyTorch scan, a wrong provider caught before
timing, and the smoke run with our providers (the Triton one where ssd_combined exists) and
mamba_ssm's where it imports."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.kernels import benchmark_ssd as bench
from benchmarks.kernels import ssd_bench_cases as cases
from tests.utils import run_module

KERNELS = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"


def test_work_counts():
    chunk = cases.Case("c", (256,), (False,))
    # Codestral layer: CB 2 L^2 N G, CB @ x 2 L^2 P H, states and output 4 L P N H, passing
    expected = 2 * 256**2 * 128 * 8 + 2 * 256**2 * 64 * 128 + 4 * 256 * 64 * 128 * 128
    assert chunk.flops() == expected + 2 * 64 * 128 * 128
    assert 8.8e6 < chunk.flops() / 256 < 9.0e6
    # a partial chunk counts its own length; two sequences are two chunks
    assert cases.Case("c", (300,), (False,)).flops() > chunk.flops()
    two = cases.Case("c", (256, 44), (False, False))
    assert two.flops() == cases.Case("c", (300,), (False,)).flops()
    case = cases.CASES["1x2048"]
    tokens = 2048 * (2 * 128 * 64 + 128 + 2 * 8 * 128) * 2
    assert case.bytes_moved(2, 4) == tokens + 128 * 64 * 128 * 4 + 3 * 128 * 4
    init = cases.CASES["16x512_init"]
    assert init.bytes_moved(2, 4) - cases.CASES["16x512"].bytes_moved(2, 4) == 16 * 4 * 2**20


@pytest.mark.parametrize("name", ["smoke_mixed", "smoke_2x12"])
def test_reference_agrees_with_our_torch_scan(name):
    from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
        chunk_scan_varlen,
        plan_chunked_scan,
    )

    case = cases.SMOKE_CASES[name]
    inp = cases.build_inputs(case, torch.float32, torch.float32, "cpu", seed=3)
    y, states = cases.reference(case, inp)
    layout = plan_chunked_scan(inp.qsl_cpu.diff(), case.shape.chunk)
    initial = torch.where(inp.init[:, None, None, None], inp.pool[inp.idx.long()], 0.0)
    out, final = chunk_scan_varlen(
        inp.x, inp.dt, inp.A, inp.B, inp.C, layout, initial, D=inp.D, dt_bias=inp.dt_bias,
        dt_softplus=True,
    )  # fmt: skip
    assert cases.rel_l2(out, y) < 1e-5 and cases.rel_l2(final, states) < 1e-5
    assert y.abs().max() > 0.1 and states.abs().max() > 1e-3  # not a trivial case


def test_check_fails_a_wrong_provider():
    case = cases.SMOKE_CASES["smoke_mixed"]
    inp = cases.build_inputs(case, torch.float32, torch.float32, "cpu", seed=0)
    inp.ref_y, inp.ref_states = cases.reference(case, inp)
    res = bench.Result(case.name, "wrong", case.tokens, case.seqs)
    bench.check(lambda pool: torch.zeros_like(inp.x), case, inp, res, tol=1e-3)
    assert res.status == "FAIL" and res.y_rel_l2 == pytest.approx(1.0)

    def scribbles(pool):  # right output, but writes a line no sequence owns
        pool[[i for i in range(pool.shape[0]) if i not in inp.idx.tolist()][0]] = 0.0
        return inp.ref_y

    res = bench.Result(case.name, "scribbles", case.tokens, case.seqs)
    bench.check(scribbles, case, inp, res, tol=1e-3)
    assert res.status == "FAIL" and "other_lines_untouched=False" in res.note


def test_smoke_run_our_providers(tmp_path):
    rc = bench.main(["--smoke", "--providers", "triton", "torch", "--out", str(tmp_path)])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "ssd_bench.csv")))
    assert {(r["case"], r["provider"]) for r in rows} == {
        (c, p) for c in ("smoke_mixed", "smoke_2x12") for p in ("triton", "torch")
    }
    for r in rows:
        if r["provider"] == "triton" and r["status"] == "n/a":
            assert "ssd_combined not importable" in r["note"]
            continue
        # fp32 on the CPU (the interpreter); bf16 where the box runs it on its GPU
        assert r["status"] == "ok", r
        assert float(r["us"]) > 0 and float(r["y_rel_l2"]) < 1e-2
        assert float(r["state_rel_l2"]) < 1e-2 and float(r["gflop"]) > 0
    saved = json.loads((tmp_path / "ssd_bench.json").read_text())
    assert saved["environment"]["git_sha"] and "--smoke" in saved["environment"]["command"]
    assert saved["upstream_autotune"] == {}  # upstream was not run
    text = (tmp_path / "ssd_bench.md").read_text()
    assert "| smoke_mixed | torch | ok |" in text


def test_upstream_autotune_choices_read_what_the_autotuners_kept(monkeypatch):
    """The record of upstream's choices reads each Autotuner's cache (key -> best config) in
    the modules of the upstream_vllm033.ops package, and nothing elsewhere."""
    import types

    triton = pytest.importorskip("triton")
    from triton.runtime.autotuner import Autotuner

    from benchmarks.kernels.ssd_bench_providers import upstream_autotune_choices

    def kernel(x_ptr):
        pass

    configs = [triton.Config({"BLOCK_SIZE_M": 64}, num_warps=4, num_stages=2)]
    tuner = Autotuner(kernel, ["x_ptr"], configs, ["n"], None, None)
    tuner.cache[(128, "torch.bfloat16")] = configs[0]
    idle = Autotuner(kernel, ["x_ptr"], configs, ["n"], None, None)  # never called: no entry
    mod = types.ModuleType("upstream_vllm033.ops.ssd_fake")
    mod._fake_kernel, mod._idle_kernel = tuner, idle
    other = types.ModuleType("elsewhere")
    other._fake_kernel = tuner
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules, "elsewhere", other)
    got = upstream_autotune_choices()
    assert list(got) == ["ssd_fake._fake_kernel"]
    ((key, config),) = got["ssd_fake._fake_kernel"].items()
    assert key == str((128, "torch.bfloat16"))
    assert "BLOCK_SIZE_M: 64" in config and "num_warps: 4" in config


def test_smoke_run_mamba_ssm(tmp_path):
    # Probed in a fresh process: the import puts a stub mamba_ssm package into sys.modules,
    # which would change what transformers imports in this one.
    probe = run_module("benchmarks.common.mamba_ssm_import", capture_output=True, text=True)
    if probe.returncode:
        reason = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"mamba_ssm's Triton ops do not import here: {reason}")
    # A fresh process: the interpreter shims mamba_ssm needs on the CPU are process-wide.
    argv = ["--smoke", "--reps", "1", "--providers", "mamba_ssm", "mamba_ssm_batch"]
    run_module(
        "benchmarks.kernels.benchmark_ssd",
        *argv,
        "--out",
        tmp_path,
        check=True,
        capture_output=True,
    )
    rows = {(r["case"], r["provider"]): r for r in csv.DictReader(open(tmp_path / "ssd_bench.csv"))}
    refused = rows["smoke_mixed", "mamba_ssm"]
    assert refused["status"] == "refused" and "initial_states" in refused["note"]
    assert rows["smoke_mixed", "mamba_ssm_batch"]["status"] == "n/a"  # unequal lengths
    for provider in ("mamba_ssm", "mamba_ssm_batch"):
        r = rows["smoke_2x12", provider]
        assert r["status"] == "ok" and float(r["y_rel_l2"]) < 1e-2, r

"""benchmarks/accuracy/benchmark_precision.py on the CPU: the tiny model, ours (PyTorch paths in
bf16) and HF bf16 against HF's fp32 PyTorch reference; and the reference's forced PyTorch
path holding when transformers resolved its entry points to other kernels."""

from __future__ import annotations

import functools
import inspect
import json
import os

import pytest
import torch

from benchmarks.accuracy import benchmark_precision as bench
from benchmarks.accuracy import precision_systems as ps

LENS = [5, 17, 40, 9, 33]


def test_tiny_on_cpu(tmp_path, capsys):
    interpret = os.environ.get("TRITON_INTERPRET")
    out, md = tmp_path / "p.json", tmp_path / "p.md"
    lens = ",".join(map(str, LENS))
    argv = ["--tiny", "--device", "cpu", "--prompt-lens", lens]
    res = bench.main([*argv, "--out", str(out), "--md", str(md)])
    assert os.environ.get("TRITON_INTERPRET") == interpret  # restored after our CPU run
    saved = json.loads(out.read_text())
    assert saved["markdown"] == md.read_text() == res["markdown"]
    assert saved["setup"]["model_config"]["hidden_size"] == 64
    assert saved["setup"]["num_layers"] == 2 and saved["setup"]["prompt_lens"] == LENS
    assert "TRITON_INTERPRET=0" in saved["setup"]["ours_path"]
    calls = saved["setup"]["reference_calls"]  # one per prompt and layer
    assert calls["mamba2_chunk_scan"] == calls["causal_conv1d_fn"] == len(LENS) * 2
    systems = saved["systems"]
    assert set(systems) == {"ours_fresh", "ours_mixed", "hf_bf16"}
    for name, r in systems.items():
        # bf16 against fp32 is never exact: a zero would mean a reference judging itself
        assert r["finite"] and 1e-4 < r["rel_l2"] < 0.03, (name, r)
        assert 0 < r["max_abs"] < 0.2 and len(r["per_prompt_rel_l2"]) == len(LENS)
        assert max(r["per_prompt_rel_l2"]) < 0.05
    hf = systems["hf_bf16"]
    assert hf["kernels"]["fast_scan"] is False and "not on CUDA (auto)" in hf["kernels_note"]
    for name in ("ours_fresh", "ours_mixed"):
        assert saved["ratios"][name] == pytest.approx(systems[name]["rel_l2"] / hf["rel_l2"])
    assert saved["target_met"] is None and saved["target"].startswith("not judged")
    roles = ["fresh", "chunked 10+7", "decode", "fresh", "chunked 19+14"]
    assert saved["mixed_roles"] == roles
    assert saved["mixed_vs_fresh_rel_l2"] < 1e-2
    printed = capsys.readouterr().out
    assert "| ours_mixed |" in printed and "17: chunked 10+7" in printed


def test_reference_unwraps_other_kernels(monkeypatch):
    """transformers resolved the scan to another kernel (here one that must not run):
    inside hf_torch_path HF's PyTorch scan runs and is counted; outside, the other one."""
    from transformers.models.mamba2 import modeling_mamba2 as module

    from tests.models.mamba2_utils import hf_config, make_hf_model

    torch_fn = inspect.unwrap(module.mamba2_chunk_scan)

    @functools.wraps(torch_fn)
    def other_kernel(*args, **kwargs):
        raise AssertionError("the other kernel ran")

    monkeypatch.setattr(module, "mamba2_chunk_scan", other_kernel)
    hf = make_hf_model(hf_config(), seed=3)
    with ps.hf_torch_path() as calls:
        logits = ps.hf_last_logits(hf, [[1, 2, 3], [4, 5, 6, 7]], torch.device("cpu"))
    assert calls["mamba2_chunk_scan"] == 2 * 2 and logits.isfinite().all()
    assert module.mamba2_chunk_scan is other_kernel
    with pytest.raises(AssertionError, match="the other kernel ran"):
        ps.hf_last_logits(hf, [[1, 2, 3]], torch.device("cpu"))


def test_reference_refuses_code_that_is_not_hfs(monkeypatch):
    from transformers.models.mamba2 import modeling_mamba2 as module

    before = {name: getattr(module, name) for name in ("causal_conv1d_fn", "causal_conv1d_update")}
    monkeypatch.setattr(module, "mamba2_chunk_scan", ps.free)
    with pytest.raises(RuntimeError, match="mamba2_chunk_scan does not wrap HF's PyTorch code"):
        with ps.hf_torch_path():
            pass
    assert all(getattr(module, name) is fn for name, fn in before.items())  # nothing swapped


def test_errors_and_arguments():
    ref = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    e = bench.errors(ref + torch.tensor([[0.3, 0.4], [0.0, 0.0]]), ref)
    assert e["rel_l2"] == pytest.approx(0.5 / 26**0.5) and e["max_abs"] == pytest.approx(0.4)
    assert e["per_prompt_rel_l2"] == pytest.approx([0.1, 0.0]) and e["finite"]
    assert bench.parse_args(["--tiny"]).num_layers == 2
    assert bench.parse_args([]).prompt_lens == [37, 61, 128, 200, 256, 383, 512, 700]
    for bad in (["--prompt-lens", "8,1"], ["--prompt-lens", "a"], ["--num-layers", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)

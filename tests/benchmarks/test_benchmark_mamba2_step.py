"""benchmarks/engine/benchmark_mamba2_step.py on the CPU: tiny model, Triton under the interpreter,
the CUDA backend skipped with its reason; timings, profile and JSON come out complete."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import benchmark_mamba2_step as bench

SMALL = ["--model", "tiny", "--device", "cpu", "--prefill-len", "16", "--num-decodes", "2"]


def test_tiny_step_on_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0")  # the script sets it per backend
    out = tmp_path / "step.json"
    argv = [*SMALL, "--decode-batch", "3", "--iters", "2", "--warmup", "0"]
    res = bench.main([*argv, "--profile", "--profile-steps", "1", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["setup"]["tokens"] == {"mixed": 18, "decode": 3}
    assert saved["setup"]["model_config"]["hidden_size"] == 64
    assert saved["setup"]["dtype"] == "float32" and saved["setup"]["device"] == "cpu"
    triton = saved["backends"]["triton"]
    assert set(triton) >= {"mixed", "decode", "profile", "pool_gib"}
    assert "decode_graph" not in triton and "graph_capture" not in triton  # CUDA only
    for kind in ("mixed", "decode"):
        ms = triton[kind]["ms"]
        assert len(triton[kind]["samples_ms"]) == 2
        assert 0 < ms["p20"] <= ms["median"] <= ms["p80"]
        prof = triton["profile"][kind]
        assert prof["steps"] == 1 and prof["share"]["conv"] > 0 and prof["share"]["scan"] > 0
        assert sum(prof["share"].values()) == pytest.approx(1.0, abs=1e-6)
    # The host's self time by event, per eager step kind: the model's ops are there.
    for kind in ("mixed", "decode"):
        names = {op["name"] for op in triton["host_ops"][kind]}
        assert "aten::linear" in names or "aten::mm" in names or "aten::addmm" in names, names
        assert all(op["us_per_step"] >= 0 and op["per_step"] > 0 for op in triton["host_ops"][kind])
    assert "Host self time of the mixed step" in saved["markdown"]
    assert "CPU" in saved["backends"]["cuda"]["skipped"]
    assert saved["check"] == {"triton_logits_finite": True}
    assert "triton_over_cuda" not in saved
    printed = capsys.readouterr().out
    assert "[cuda] skipped:" in printed and "| triton | mixed | 18 |" in printed
    assert res["markdown"] == saved["markdown"]


def test_rejects_unknown_backend():
    with pytest.raises(SystemExit):
        bench.main([*SMALL, "--backends", "triton,rocm"])


def test_the_default_limit_holds_the_mixed_step():
    """Without --max-num-batched-tokens the limit is the mixed step's own tokens, so its
    graph bucket exists (a fixed 2,048 left the default 255 decodes + 2,048 prompt tokens
    outside every bucket, ending the run before its decode step); a given limit is kept."""
    assert bench.parse_args([]).max_num_batched_tokens == 255 + 2048
    assert bench.parse_args(["--num-decodes", "127"]).max_num_batched_tokens == 127 + 2048
    assert bench.parse_args(["--max-num-batched-tokens", "4096"]).max_num_batched_tokens == 4096

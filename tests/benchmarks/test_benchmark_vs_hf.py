"""benchmarks/engine/benchmark_vs_hf.py on the CPU: ours and HF on the same tiny workload, each a
fresh process with --prefill-run, the ratios and the notes in the table."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import benchmark_vs_hf as vs_hf


def test_tiny_ours_and_hf(tmp_path):
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip(f"Triton's interpreter fails with numpy {numpy.__version__} (>= 2.4)")
    out, md = tmp_path / "vs.json", tmp_path / "vs.md"
    argv = ["--model", "tiny", "--device", "cpu", "--num-prompts", "2", "--input-len", "6"]
    argv += ["--output-len", "3", "--systems", "ours-2048-bf16,hf", "--out", str(out)]
    res = vs_hf.main([*argv, "--md", str(md)])
    ours, hf = res["runs"]
    assert "error" not in ours and "error" not in hf
    for run in (ours, hf):
        x = run["result"]
        assert x["output_tokens"] == 6 and x["prefill_tokens_per_s"] > 0
        assert x["setup"]["args"]["temperature"] == 0
    assert ours["result"]["setup"]["ssm_state_dtype"] == "torch.bfloat16"
    assert ours["result"]["setup"]["args"]["max_num_seqs"] == 2
    assert hf["result"]["hf"]["batch_size"] == 2
    text = md.read_text()
    assert text == json.loads(out.read_text())["markdown"]
    assert "| ours-2048-bf16 |" in text and "x | state bfloat16, cold |" in text
    assert "PyTorch scan (not on CUDA (auto)), PyTorch conv; warm" in text


def test_lfm2_shape_ours_and_hf(tmp_path):
    """A new architecture's CPU stand-in (lfm2-cpu): --max-model-len reaches ours only,
    --hf-batch-size HF only, and HF's row says it has no scan."""
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip(f"Triton's interpreter fails with numpy {numpy.__version__} (>= 2.4)")
    argv = ["--model", "lfm2-cpu", "--device", "cpu", "--num-prompts", "2", "--input-len", "5"]
    argv += ["--output-len", "2", "--systems", "ours-2048-fp32,hf", "--max-model-len", "32"]
    res = vs_hf.main([*argv, "--hf-batch-size", "1", "--out", str(tmp_path / "vs.json")])
    ours, hf = res["runs"]
    assert "error" not in ours and "error" not in hf
    assert ours["result"]["setup"]["args"]["max_model_len"] == 32
    assert "--max-model-len" not in hf["argv"] and "--hf-batch-size" not in ours["argv"]
    assert hf["result"]["hf"]["architecture"] == "Lfm2ForCausalLM"
    assert hf["result"]["hf"]["batch_size"] == 1
    assert "| no scan, PyTorch conv; warm; batch 1;" in res["markdown"]
    assert res["markdown"].startswith("# lfm2-cpu: this project vs HF transformers")


def test_bad_systems():
    with pytest.raises(SystemExit):
        vs_hf.parse_args(["--systems", "ours-4096-fp32"])


@pytest.mark.parametrize("arch", ["FalconMambaForCausalLM", "MambaForCausalLM", "JambaForCausalLM"])
def test_mamba1_hf_keeps_its_pytorch_scan(arch, monkeypatch):
    """mamba_ssm's Mamba1 scan is a CUDA op its pure-Python wheel lacks: HF must not be
    handed the package (it would take the scan and fail calling it, as on the box)."""
    import sys

    from benchmarks.common import hf_generate

    monkeypatch.delitem(sys.modules, "selective_scan_cuda", raising=False)
    why = hf_generate.prepare_kernels("auto", True, arch)
    assert arch in why and "CUDA op" in why
    assert "selective_scan_cuda" not in sys.modules  # nothing was put in place
    with pytest.raises(SystemExit, match="--hf-kernels mamba_ssm"):
        hf_generate.prepare_kernels("mamba_ssm", True, arch)
    assert hf_generate.prepare_kernels("torch", True, arch) == "--hf-kernels torch"

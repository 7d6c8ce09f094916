"""benchmarks/engine/benchmark_throughput.py on the CPU with the tiny config: every prompt source,
fixed lengths, the cold Triton cache, the prefill run, the profile and the HF backend; then
the CPU stand-ins of the other architectures' shapes, ours and HF's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.engine import benchmark_throughput as bench
from tests.utils import run_module

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_throughput.py"


COMMON = [
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--max-num-seqs",
    "4",
    "--max-num-batched-tokens",
    "16",
]


def test_synthetic_prompts(tmp_path, capsys):
    out = tmp_path / "r.json"
    res = bench.main(
        [
            *COMMON,
            "--num-prompts",
            "3",
            "--max-prompt-len",
            "6",
            "--output-len",
            "2",
            "--out",
            str(out),
        ]
    )
    assert res["num_requests"] == 3 and res["output_tokens"] == 6
    assert res["output_tokens_per_s"] > 0 and res["requests_per_s"] > 0
    saved = json.loads(out.read_text())
    assert saved["setup"]["model_config"]["hidden_size"] == 64
    # The engine's steps in the timed run: every prompt token prefilled once, every
    # output token after the first decoded; steps fill (nearly) all of its wall time.
    steps = saved["step_stats"]
    assert steps["prefill_tokens"] == res["prompt_tokens"] and steps["decode_tokens"] == 3
    # Step calls: the batches dispatched, and (async scheduling) a last call that only reads.
    assert steps["num_steps"] == res["setup"]["engine_steps"] + 1
    assert steps["num_steps"] > steps["num_steps_with_prefill"] > 0
    assert steps["wall_s"] == res["elapsed_s"] and 0.5 < steps["share_of_wall_in_steps"] <= 1
    assert steps["mean_step_ms_with_prefill"] > 0 and "loop_wait_s" not in steps
    assert "requests/s" in capsys.readouterr().out


def test_long_prefill_token_threshold_reaches_the_engine(tmp_path):
    """One 12-token prompt, the engine's threshold 4: three batches with prompt tokens
    (under async scheduling the call that dispatches the first decode waits on the last
    of them: four step calls), where the 16-token budget alone would take one."""
    out = tmp_path / "r.json"
    argv = [*COMMON, "--num-prompts", "1", "--input-len", "12", "--output-len", "2"]
    res = bench.main([*argv, "--long-prefill-token-threshold", "4", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["setup"]["args"]["long_prefill_token_threshold"] == 4
    steps = saved["step_stats"]
    assert steps["prefill_tokens"] == res["prompt_tokens"] == 12
    assert steps["num_steps_with_prefill"] == 4


def test_sharegpt_file(tmp_path):
    data = [
        {
            "conversations": [
                {"from": "human", "value": "hi there"},
                {"from": "gpt", "value": "hello!"},
            ]
        },
        {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "yyyy"}]},
        {"conversations": [{"from": "human", "value": "tell me"}, {"from": "gpt", "value": "abc"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    res = bench.main([*COMMON, "--dataset", str(path), "--num-prompts", "1"])
    # "x" and "abc" are under 4 tokens and dropped: only the first pair is left (bytes)
    assert res["num_requests"] == 1
    assert (res["prompt_tokens"], res["output_tokens"]) == (8, 6)
    with pytest.raises(SystemExit):
        bench.main([*COMMON, "--dataset", str(path), "--num-prompts", "2"])


def test_profile_and_phases(capsys):
    res = bench.main(
        [
            *COMMON,
            "--num-prompts",
            "3",
            "--max-prompt-len",
            "5",
            "--output-len",
            "3",
            "--profile",
            "--profile-decode-steps",
            "2",
        ]
    )
    assert res["output_tokens"] == 9
    # no warm-up of the benchmark's own: start-up, the first token, the run, the profile
    assert set(res["phases"]) == {"startup_s", "first_token_s", "elapsed_s", "profile_s"}
    assert 0 < res["startup_s"] < res["first_token_s"]
    assert res["setup"]["cuda_graphs"] is False
    # 3 prompts of <= 5 tokens fit one 16-token step, then two decode steps: the first-token
    # generation's steps are not counted
    assert res["setup"]["engine_steps"] == 3
    prof = res["profile"]
    assert prof["_requests"]["prompts"] == 3
    assert prof["mixed"]["steps"] == 1 and prof["decode"]["steps"] == 2
    for kind in ("mixed", "decode"):
        shares = prof[kind]["share"]
        assert shares["conv"] > 0 and shares["scan"] > 0
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert "| triton | decode | 2 |" in capsys.readouterr().out


def test_fixed_lengths_prefill_run_and_state_dtype(tmp_path):
    cache = tmp_path / "cache"
    argv = [*COMMON, "--num-prompts", "3", "--input-len", "5", "--output-len", "2"]
    argv += ["--prefill-run", "--no-first-token", "--mamba-ssm-cache-dtype", "bfloat16"]
    res = bench.main([*argv, "--triton-cache-dir", str(cache)])
    assert (res["prompt_tokens"], res["output_tokens"]) == (15, 6)
    assert res["prefill_tokens_per_s"] > 0 and "prefill_run_s" in res["phases"]
    assert res["first_token_s"] is None and "first_token_s" not in res["phases"]
    assert res["setup"]["ssm_state_dtype"] == "torch.bfloat16"
    # a given cache folder is used as it is and kept; the variable is restored afterwards
    info = res["triton_cache"]
    assert info["given"] and info["dir"] == str(cache) and cache.is_dir()
    assert os.environ.get("TRITON_CACHE_DIR") != str(cache)


def test_fresh_process_compiles_into_a_fresh_cache(tmp_path):
    """Run as a module (a fresh process): an empty Triton cache of its own, set before
    triton is imported, recorded as cold and removed at the end."""
    out = tmp_path / "r.json"
    argv = [*COMMON, "--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--out", out]
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "not_this_one"))
    run_module(
        "benchmarks.engine.benchmark_throughput", *argv, env=env, check=True, capture_output=True
    )
    info = json.loads(out.read_text())["triton_cache"]
    assert info["cold"] and not info["given"] and not info["triton_imported_before"]
    assert info["entries_at_start"] == 0 and info["dir"] != env["TRITON_CACHE_DIR"]
    assert not Path(info["dir"]).exists()


def test_hf_backend_on_cpu():
    argv = ["--backend", "hf", "--model", "tiny", "--device", "cpu", "--num-prompts", "3"]
    argv += ["--input-len", "6", "--output-len", "3", "--hf-batch-size", "2"]
    res = bench.main([*argv, "--temperature", "0", "--prefill-run", "--hf-kernels", "torch"])
    assert res["backend"] == "hf" and res["output_tokens"] == 9
    assert res["prefill_tokens_per_s"] > 0 and res["first_token_s"] > res["startup_s"] > 0
    hf = res["hf"]
    assert (hf["batches"], hf["batch_size"], hf["decode_steps"]) == (2, 2, 4)
    assert hf["kernels"]["fast_scan"] is False and hf["kernels"]["mamba2_chunk_scan"] == "torch"
    assert hf["mamba_ssm_not_used_because"] == "--hf-kernels torch"
    assert hf["parameters"] > 0 and "warmup_s" in res["phases"]
    assert res["setup"]["model_config"]["hidden_size"] == 64 and res["setup"]["transformers"]


def test_bad_arguments():
    for bad in (
        ["--backend", "hf", "--output-len", "2"],  # hf needs fixed lengths
        ["--input-len", "4"],  # and so does --input-len
        ["--input-len", "4", "--output-len", "2", "--dataset", "x.json"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bamba_shape_with_dummy_weights(tmp_path):
    """The hybrid preset path (bamba-tiny, the CPU stand-in of bamba-9b): a KV cache is
    sized and recorded, the config is Bamba's."""
    out = tmp_path / "bamba.json"
    res = bench.main(
        ["--model", "bamba-tiny", "--device", "cpu", "--max-num-seqs", "2",
         "--max-num-batched-tokens", "8", "--num-prompts", "2", "--input-len", "5",
         "--output-len", "2", "--block-size", "8", "--num-gpu-blocks-override", "1024",
         "--no-first-token", "--out", str(out)]
    )  # fmt: skip
    assert res["output_tokens"] == 4
    saved = json.loads(out.read_text())
    assert saved["setup"]["model_config"]["attn_layer_indices"] == [1]
    assert saved["engine_startup"]["num_kv_blocks"] == 1024


# The CPU stand-ins of falcon-mamba-7b, lfm2-1.2b, granite-4.0-h-tiny and nemotron-3-nano:
# the architecture each runs as, and the kernels HF's module resolved (its scan: None for
# LFM2, which has none).
NEW_SHAPES = {
    "falcon-mamba-cpu": ("FalconMambaForCausalLM", "mamba_selective_scan", False),
    "lfm2-cpu": ("Lfm2ForCausalLM", None, None),
    "granite-4.0-h-cpu": ("GraniteMoeHybridForCausalLM", "mamba2_chunk_scan", False),
    "nemotron-3-nano-cpu": ("NemotronHForCausalLM", "mamba2_chunk_scan", False),
}
SMALL = ["--device", "cpu", "--num-prompts", "2", "--input-len", "5", "--output-len", "2"]
SMALL += ["--temperature", "0", "--no-first-token"]


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_new_architecture_shapes_ours(name):
    argv = [*SMALL, "--model", name, "--max-num-seqs", "2", "--max-num-batched-tokens", "8"]
    res = bench.main([*argv, "--max-model-len", "64"])
    assert res["output_tokens"] == 4 and res["setup"]["args"]["max_model_len"] == 64
    assert res["step_stats"]["prefill_tokens"] == 10
    assert res["setup"]["model_config"]["hidden_size"] == 32


@pytest.mark.parametrize("name", NEW_SHAPES)
def test_new_architecture_shapes_hf(name):
    architecture, scan, fast_scan = NEW_SHAPES[name]
    res = bench.main(["--backend", "hf", "--model", name, *SMALL, "--hf-kernels", "torch"])
    assert res["backend"] == "hf" and res["output_tokens"] == 4
    hf = res["hf"]
    assert hf["architecture"] == architecture and hf["decode_steps"] == 1
    assert hf["kernels"]["fast_scan"] is fast_scan and hf["kernels"]["fast_conv"] is False
    assert (scan in hf["kernels"]) if scan else "mamba2_chunk_scan" not in hf["kernels"]
    assert res["setup"]["model_config"]["hidden_size"] == 32

"""benchmarks/engine/benchmark_e2e.py on the CPU: each run a fresh process with its backend's
environment and its own fresh Triton cache (cold), token counts checked, the CUDA backend
skipped with its reason, the time guard, cold-then-warm runs, and the markdown / JSON
results."""

from __future__ import annotations

import json

import pytest

from benchmarks.engine import benchmark_e2e as e2e
from tests.utils import INTERPRETER_BLOCKER

pytestmark = pytest.mark.skipif(INTERPRETER_BLOCKER is not None, reason=INTERPRETER_BLOCKER or "")


TINY = ["--model", "tiny", "--device", "cpu", "--num-prompts", "3", "--max-prompt-len", "5"]
TINY += ["--max-num-seqs", "4", "--max-num-batched-tokens", "16"]


def test_tiny_runs_profile_and_budget(tmp_path):
    out, md = tmp_path / "e2e.json", tmp_path / "e2e.md"
    # A budget of 1 ms: the first output length runs (nothing to predict from yet), the
    # second is predicted not to fit and is skipped.
    argv = [*TINY, "--output-lens", "2,3", "--profile", "--budget-s", "0.001"]
    res = e2e.main([*argv, "--out", str(out), "--md", str(md)])
    saved = json.loads(out.read_text())
    assert saved["runs"] == json.loads(json.dumps(res["runs"], default=str))
    first, second = saved["runs"]
    assert (first["backend"], first["output_len"]) == ("triton", 2)
    x = first["result"]
    assert x["num_requests"] == 3 and x["output_tokens"] == 3 * 2 and first["output_tokens_ok"]
    for key in ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s", "elapsed_s"):
        assert x[key] > 0
    assert x["total_tokens_per_s"] > x["output_tokens_per_s"]
    assert x["setup"]["conv_backend"] == "triton" and x["setup"]["VLLM_USE_TRITON_CONV1D"] == "1"
    assert {"mixed", "decode"} <= set(x["profile"])
    assert first["wall_s"] > x["elapsed_s"]
    # cold by default: the child compiled into a fresh empty cache of its own
    assert first["cache"] == "cold" and x["startup_s"] > 0
    assert x["triton_cache"]["cold"] and not x["triton_cache"]["given"]
    assert second["output_len"] == 3 and "predicted" in second["skipped"]
    assert "CPU" in saved["skipped_backends"]["cuda"]
    assert saved["triton_over_cuda"] == {}
    text = md.read_text()
    assert "| 2 | triton | cold | " in text and "Backend cuda skipped" in text
    assert "fresh empty Triton cache per run" in text
    assert "| triton | decode |" in text  # the profile table
    assert text == saved["markdown"]


def test_cold_then_warm(tmp_path):
    res = e2e.main([*TINY, "--output-lens", "2", "--cold-warm"])
    cold, warm = res["runs"]
    assert (cold["cache"], warm["cache"]) == ("cold", "warm")
    c, w = cold["result"]["triton_cache"], warm["result"]["triton_cache"]
    assert c["given"] and w["given"] and c["dir"] == w["dir"]  # one folder for both
    assert c["entries_at_start"] == 0
    (ratio,) = res["warm_over_cold"]
    assert ratio["backend"] == "triton" and ratio["warm_over_cold"] > 0
    assert res["triton_over_cuda"] == {}
    assert "| 2 | triton | warm | " in res["markdown"] and "warm / cold" in res["markdown"]


def test_cuda_run_gets_its_environment(tmp_path):
    """Without the CUDA ops, a CUDA-backend child fails building the model, which shows
    it was started with VLLM_USE_TRITON_CONV1D=0; the failure is recorded, not raised."""
    args = e2e.parse_args([*TINY, "--output-lens", "2"])
    args.dtype = "float32"
    run = e2e.run_one(args, "cuda", 2, False, tmp_path, on_cuda=False)
    assert "result" not in run and run["error"].startswith("exit status 1")


def test_speedups_and_prediction():
    def run(backend, n, tput, wall, elapsed):
        result = {"output_tokens_per_s": tput, "phases": {"elapsed_s": elapsed}}
        return {"backend": backend, "output_len": n, "wall_s": wall, "result": result}

    runs = [run("triton", 256, 120.0, 40.0, 25.0), run("cuda", 256, 100.0, 45.0, 30.0)]
    runs.append({"backend": "triton", "output_len": 1024, "skipped": "..."})
    assert e2e.speedups(runs) == {256: pytest.approx(1.2)}
    assert e2e.predict_s(runs, "triton", 1024) == pytest.approx(15 + 100)
    assert e2e.predict_s(runs, "cuda", 1024) == pytest.approx(15 + 120)
    assert e2e.predict_s([], "cuda", 1024) is None


def test_bad_arguments():
    for bad in (
        ["--backends", "rocm"],
        ["--output-lens", "256,x"],
        ["--output-lens", "0"],
        ["--cold-warm", "--triton-cache-dir", "/tmp/x"],
    ):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)

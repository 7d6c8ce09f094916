"""benchmarks/benchmark_e2e.py on the CPU: each run a fresh process with its backend's
environment and its own fresh Triton cache (cold), token counts checked, the CUDA backend
skipped with its reason, the time guard, cold-then-warm runs, and the markdown / JSON
results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_e2e.py"


def _interpreter_blocker() -> str | None:
    """Why the runs' Triton interpreter cannot work here, or None.

    Each CPU run is a fresh process with TRITON_INTERPRET=1. Triton 3.6's interpreter
    turns 1-element arrays into ints with int(), which numpy >= 2.4 rejects ("only
    0-dimensional arrays can be converted to Python scalars"): seen on the GPU box,
    whose numpy is newer than the numpy<2.4 the CPU CI pins.
    """
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        return f"Triton's interpreter fails with numpy {numpy.__version__} (>= 2.4)"
    return None


_BLOCKER = _interpreter_blocker()
pytestmark = pytest.mark.skipif(_BLOCKER is not None, reason=_BLOCKER or "")


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("benchmark_e2e", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--model", "tiny", "--device", "cpu", "--num-prompts", "3", "--max-prompt-len", "5"]
TINY += ["--max-num-seqs", "4", "--max-num-batched-tokens", "16"]


def test_tiny_runs_profile_and_budget(e2e, tmp_path):
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


def test_cold_then_warm(e2e, tmp_path):
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


def test_cuda_run_gets_its_environment(e2e, tmp_path):
    """Without the CUDA ops, a CUDA-backend child fails building the model, which shows
    it was started with VLLM_USE_TRITON_CONV1D=0; the failure is recorded, not raised."""
    args = e2e.parse_args([*TINY, "--output-lens", "2"])
    args.dtype = "float32"
    run = e2e.run_one(args, "cuda", 2, False, tmp_path, on_cuda=False)
    assert "result" not in run and run["error"].startswith("exit status 1")


def test_speedups_and_prediction(e2e):
    def run(backend, n, tput, wall, elapsed):
        result = {"output_tokens_per_s": tput, "phases": {"elapsed_s": elapsed}}
        return {"backend": backend, "output_len": n, "wall_s": wall, "result": result}

    runs = [run("triton", 256, 120.0, 40.0, 25.0), run("cuda", 256, 100.0, 45.0, 30.0)]
    runs.append({"backend": "triton", "output_len": 1024, "skipped": "..."})
    assert e2e.speedups(runs) == {256: pytest.approx(1.2)}
    assert e2e.predict_s(runs, "triton", 1024) == pytest.approx(15 + 100)
    assert e2e.predict_s(runs, "cuda", 1024) == pytest.approx(15 + 120)
    assert e2e.predict_s([], "cuda", 1024) is None


def test_bad_arguments(e2e):
    for bad in (
        ["--backends", "rocm"],
        ["--output-lens", "256,x"],
        ["--output-lens", "0"],
        ["--cold-warm", "--triton-cache-dir", "/tmp/x"],
    ):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)

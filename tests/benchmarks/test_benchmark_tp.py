"""benchmarks/tp/benchmark_tp.py on the CPU: the tiny Mamba2 at TP=1 and on two gloo ranks,
each configuration a fresh process; the JSON's figures (logits agreement, throughput,
step latency, the all-reduces each step makes and their cost) and the markdown; the
bf16 yardstick's arithmetic; the budget that kills a run and records why."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.tp import benchmark_tp as bench
from tests.utils import INTERPRETER_BLOCKER
from vllm.distributed.parallel_state import MULTICAST_OFF_ENV

TINY = ["--model", "tiny", "--device", "cpu", "--max-num-seqs", "4"]
TINY += ["--max-num-batched-tokens", "32", "--logits-len", "8", "--logits-decode-steps", "2"]
TINY += ["--decode-batches", "1,4", "--prefill-len", "16", "--warmup", "1", "--iters", "2"]
TINY += ["--allreduce-warmup", "1", "--allreduce-iters", "2", "--allreduce-repeats", "2"]
TINY += ["--num-prompts", "2", "--input-len", "4", "--output-len", "3"]
# The runs' CPU ranks go through Triton's interpreter (test_benchmark_e2e says when it fails).
needs_interpreter = pytest.mark.skipif(
    INTERPRETER_BLOCKER is not None, reason=INTERPRETER_BLOCKER or ""
)


@pytest.fixture
def multicast_env(monkeypatch):
    """main() sets NVLink multicast off in os.environ; put the test process's back after."""
    for key in MULTICAST_OFF_ENV:
        monkeypatch.setenv(key, "unset-by-test")


@needs_interpreter
@pytest.mark.timeout(240)
def test_tiny_on_two_gloo_ranks(tmp_path, multicast_env):
    out, md = tmp_path / "tp.json", tmp_path / "tp.md"
    res = bench.main([*TINY, "--out", str(out), "--md", str(md)])
    saved = json.loads(out.read_text())
    assert saved["markdown"] == md.read_text() == res["markdown"]
    assert saved["skipped"] == [] and not bench.failed(saved)
    assert set(saved["runs"]) == {"tp1", "tp2"}  # fp32: no separate reference run
    s = saved["setup"]
    assert (s["tp"], s["backend"], s["dtype"]) == (2, "gloo", "float32")
    for key in ("commit", "date", "argv", "shape", "environment", "rank0_device"):
        assert s[key]
    assert s["environment"]["env"] == {
        **MULTICAST_OFF_ENV,
        "CUDA_VISIBLE_DEVICES": None,
        "VLLM_USE_TRITON_CONV1D": None,
    }

    lg = saved["logits"]
    assert [r["kind"] for r in lg["steps"]] == ["prefill", "mixed", "decode", "decode"]
    assert [r["tokens"] for r in lg["steps"]] == [8 + 5 + 3, 1 + 1 + 3 + 4, 4, 4]
    assert lg["scale"] > 1.0 and lg["max_abs_diff"] < 1e-4  # fp32: one rank's logits
    assert lg["argmax_agree"] == 1.0 and lg["within_tolerance"] and not lg["reference"]

    t = saved["throughput"]
    for tp in ("tp1", "tpn"):
        assert t[tp]["output_tokens"] == 2 * 3 and t[tp]["output_tokens_per_s"] > 0
    assert t["speedup"] > 0

    layers = s["shape"]["num_hidden_layers"]
    steps = {r["step"]: r for r in saved["steps"]}
    assert list(steps) == ["decode b=1", "decode b=4", "prefill 1x16"]
    for name, tokens in (("decode b=1", 1), ("decode b=4", 4), ("prefill 1x16", 16)):
        r = steps[name]
        assert r["tokens"] == tokens and r["tp1_ms"] > 0 and r["tpn_ms"] > 0
        # n_groups 1 over two ranks: out_proj's (tokens, hidden) and the gated norm's
        # (tokens, groups) sums of squares per layer; the embedding's outside them.
        assert r["collectives"]["per_layer"] == [
            {"op": "all_reduce", "shape": [tokens, 1], "dtype": "float32"},
            {"op": "all_reduce", "shape": [tokens, 64], "dtype": "float32"},
        ]
        assert r["collectives"]["layers_alike"]
        assert r["all_reduces_per_layer"] == 2
        assert r["all_reduces_per_step"] == 2 * layers + 1
        assert r["collectives"]["by_op"] == {"all_reduce": 2 * layers + 1, "gather": 1}
        per_layer, per_step = r["all_reduce_ms_per_layer"], r["all_reduce_ms_per_step"]
        assert 0 < per_layer * layers < per_step
        assert r["all_reduce_share"] == pytest.approx(per_step / r["tpn_ms"])
    timed = {(tuple(a["shape"]), a["dtype"]) for a in saved["all_reduce"]}
    assert timed == {((n, w), "float32") for n in (1, 4, 16) for w in (1, 64)}
    assert all(a["us"]["median"] > 0 and a["us"]["n"] == 2 for a in saved["all_reduce"])
    for heading in ("## Logits", "## Throughput", "## Step latency", "| all-reduce |"):
        assert heading in saved["markdown"]


@needs_interpreter
@pytest.mark.timeout(240)
def test_bf16_runs_against_an_fp32_reference(tmp_path, multicast_env):
    """A bf16 run adds the fp32 TP=1 reference (logits steps only, eager, 4 slots)."""
    lean = ["--decode-batches", "1", "--warmup", "0", "--iters", "1", "--num-prompts", "1"]
    res = bench.main([*TINY, *lean, "--dtype", "bfloat16"])
    assert res["skipped"] == [] and not bench.failed(res)
    assert set(res["runs"]) == {"tp1", "tp2", "reference_fp32"}
    ref = res["runs"]["reference_fp32"]
    assert "latency" not in ref and "throughput" not in ref
    assert (ref["spec"]["dtype"], ref["spec"]["tp"], ref["spec"]["enforce_eager"]) == (
        "float32",
        1,
        True,
    )
    lg = res["logits"]
    assert lg["reference"] and 0 < lg["tp1_vs_ref"] and 0 < lg["tpn_vs_ref"]
    assert lg["max_abs_diff"] > 1e-4  # bf16 rounding, in another order on two ranks
    assert lg["error_ratio"] == pytest.approx(lg["tpn_vs_ref"] / lg["tp1_vs_ref"])
    assert lg["within_tolerance"] and "fp32" in lg["criterion"]
    assert "Against fp32 TP=1" in res["markdown"]


def test_the_bf16_yardstick():
    """TP=N's error against fp32 set against TP=1's: within at most BF16_ERROR_FACTOR."""
    from benchmarks.tp.tp_bench_report import BF16_ERROR_FACTOR, compare_logits

    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(4, 50, generator=gen) * 3 for _ in range(2)]
    tp1 = [r + 0.01 for r in ref]
    steps = [
        {"kind": "prefill", "rows": 4, "tokens": 9},
        {"kind": "decode", "rows": 4, "tokens": 4},
    ]
    close = compare_logits(tp1, [r - 0.015 for r in ref], ref, steps)
    assert close["tp1_vs_ref"] == pytest.approx(0.01, rel=1e-3)
    assert close["tpn_vs_ref"] == pytest.approx(0.015, rel=1e-3)
    assert close["max_abs_diff"] == pytest.approx(0.025, rel=1e-3)
    assert close["error_ratio"] == pytest.approx(1.5, rel=1e-3)
    assert close["diff_in_bf16_errors"] == pytest.approx(2.5, rel=1e-3)
    assert close["within_tolerance"] and close["argmax_agree"] == 1.0
    far = compare_logits(tp1, [r + 0.01 * (BF16_ERROR_FACTOR + 1) for r in ref], ref, steps)
    assert not far["within_tolerance"]
    flipped = [r.clone() for r in tp1]
    flipped[1][0] = -flipped[1][0]  # one row of 8 gets another greedy token
    assert compare_logits(tp1, flipped, None, steps)["argmax_agree"] == pytest.approx(7 / 8)


def test_the_budget_kills_the_run_and_says_so(tmp_path, multicast_env):
    res = bench.main([*TINY, "--budget-s", "2", "--out", str(tmp_path / "tp.json")])
    assert res["runs"] == {} and bench.failed(res)
    # tp1 killed at the budget (no time left to run it eagerly); tp2 never started.
    assert len(res["skipped"]) == 2 and "tp1 was killed after" in res["skipped"][0]
    assert res["skipped"][1] == "tp2: the budget of 2 s was spent"
    assert "**Not run:**" in res["markdown"]


def test_sizes_that_do_not_fit_are_refused():
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--prefill-len", "64"])  # over the token budget
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--decode-batches", "8"])  # over max_num_seqs
    with pytest.raises(SystemExit):
        bench.parse_args([*TINY, "--tp", "1"])

"""benchmarks/benchmark_throughput.py runs on the CPU with the tiny config, both prompt sources."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("benchmark_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_synthetic_prompts(bench, tmp_path, capsys):
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
    assert "requests/s" in capsys.readouterr().out


def test_sharegpt_file(bench, tmp_path):
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


def test_warmup_and_profile(bench, capsys):
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
    assert set(res["phases"]) == {"load_s", "warmup_s", "elapsed_s", "profile_s"}
    assert res["graph_capture"] is None and res["setup"]["cuda_graphs"] is False
    # 3 prompts of <= 5 tokens fit one 16-token step, then two decode steps: the warm-up's
    # steps are not counted
    assert res["setup"]["engine_steps"] == 3
    prof = res["profile"]
    assert prof["_requests"]["prompts"] == 3
    assert prof["mixed"]["steps"] == 1 and prof["decode"]["steps"] == 2
    for kind in ("mixed", "decode"):
        shares = prof[kind]["share"]
        assert shares["conv"] > 0 and shares["scan"] > 0
        assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert "| triton | decode | 2 |" in capsys.readouterr().out

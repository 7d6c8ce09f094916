"""benchmarks/serving/serving_sweep.py: its run list, and one real sweep on the CPU (a tiny `vllm
serve`, two rates of a ShareGPT sample through `vllm bench serve`, twice (--repeats 2),
then the offline benchmark_throughput.py run on the same requests), its files and its
summary: the repeats' spread, and the server's engine steps beside the offline ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serving.serving_sweep import offline_command, parse_runs, server_sessions
from tests.entrypoints.utils import server_env
from tests.tiny_model import make_tiny_model_dir
from tests.utils import run_module


def test_parse_runs():
    assert parse_runs("sharegpt@inf:500,256@4:120") == [("sharegpt", "inf", 500), ("256", "4", 120)]
    for bad in ("sharegpt:inf:5", "long@inf:5", "256@fast:5", "256@inf"):
        with pytest.raises(SystemExit, match="WORKLOAD@RATE:PROMPTS"):
            parse_runs(bad)


def test_offline_command_takes_the_servers_engine_sizes(tmp_path):
    import argparse

    args = argparse.Namespace(
        model="M",
        dataset_path="s.json",
        seed=3,
        server_args="--load-format dummy --dtype bfloat16 --max-num-seqs 256 --port 1 "
        "--long-prefill-token-threshold 512",
    )
    cmd = offline_command(args, "1024", 500, tmp_path / "o.json")
    line = " ".join(cmd[1:])
    assert "--load-format dummy --dtype bfloat16 --max-num-seqs 256" in line
    assert "--long-prefill-token-threshold 512" in line
    assert "--dataset s.json --output-len 1024 --num-prompts 500 --max-output-len 2048" in line
    assert "--temperature 0 --seed 3" in line and "--port" not in line


def run_sweep(tmp_path, turns: list[str], args: list[str]) -> tuple[Path, dict]:
    """serving_sweep.py on a tiny model and a ShareGPT file of ``turns`` (question, answer,
    ...); its output directory and its runs by name. One layer: the runs, their files and
    the summary are checked, not the model, and each interpreted step costs half."""
    model = make_tiny_model_dir(tmp_path / "tiny", num_hidden_layers=1)
    records = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}],
        }
        for i, (q, a) in enumerate(zip(turns[::2], turns[1::2], strict=True))
    ]
    (tmp_path / "sample.json").write_text(json.dumps(records))
    out = tmp_path / "sweep"
    args = ["--model", model, "--dataset-path", tmp_path / "sample.json", "--out", out, *args]
    proc = run_module(
        "benchmarks.serving.serving_sweep", *args, env=server_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["name"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    return out, runs


def test_a_tiny_sweep(tmp_path):
    turns = ["What is a state space model?", "A model with a state.", "Say hi.", "Hi there!"]
    # 4 output tokens: benchmark_throughput.py drops pairs under 4, even of a fixed length.
    args = ["--conv-backends", "1", "--runs", "4@inf:2,4@50:2", "--offline", "4:2"]
    args += ["--repeats", "2"]
    args += ["--server-args", "--load-format dummy --max-num-seqs 4 --max-model-len 128"]
    out, runs = run_sweep(tmp_path, turns, args)
    assert runs["server conv1"]["exit_status"] == 0
    names = [f"conv1-4-rate{r}-r{i}" for i in (0, 1) for r in ("inf", "50")]
    assert [n for n in runs if n.startswith("conv1")] == names  # the list, then again
    serving = [json.loads((out / f"{n}.json").read_text()) for n in names]
    for res in serving:
        assert (res["completed"], res["failed"], res["total_output_tokens"]) == (2, 0, 8)
        assert res["conv_backend"] == "triton" and res["VLLM_USE_TRITON_CONV1D"] == "1"
        # Made by the CLI, with the server's engine steps of the run.
        assert res["command"][:3] == ["vllm", "bench", "serve"]
        assert res["server_step_stats"]["decode_tokens"] == 2 * 3
    assert [r["request_rate"] for r in serving] == ["inf", 50.0] * 2
    assert [r["repeat"] for r in serving] == ["0", "0", "1", "1"]
    offline = json.loads((out / "offline-conv1-4.json").read_text())
    # The same two requests offline: the same prompt tokens (the server counts BOS too).
    assert offline["prompt_tokens"] == serving[0]["total_input_tokens"]
    assert offline["output_tokens"] == 8
    assert offline["step_stats"]["decode_tokens"] == 2 * 3
    md = (out / "sweep.md").read_text()
    assert md.count("| ShareGPT, 4 output tokens | triton |") == 4 and "offline-conv1-4" in md
    assert "| conv1-4-rateinf | 2 | " in md and "| offline-conv1-4 | 1 | " in md  # repeats
    steps = [line for line in md.splitlines() if line.startswith("| conv1-4-rate")]
    assert len(steps) == 2 + 4  # the repeats table's two items, the steps table's four runs
    assert "| offline-conv1-4 | " in md.split("Engine steps")[1]
    assert "- conv1-4-rateinf vs offline-conv1-4: server / offline output tok/s = " in md


def test_server_sessions_interleave_abba():
    assert server_sessions(["A", "B"], 3, False) == [("A", [0, 1, 2]), ("B", [0, 1, 2])]
    assert server_sessions(["A", "B"], 4, True) == [
        ("A", [0]), ("B", [0]), ("B", [1]), ("A", [1]), ("A", [2]), ("B", [2]), ("B", [3]),
        ("A", [3]),
    ]  # fmt: skip
    assert server_sessions(["A"], 2, True) == [("A", [0]), ("A", [1])]


def test_an_interleaved_sweep_over_both_engine_modes(tmp_path):
    """--engine-process 1,0: servers with the engine core in its own process and on a
    thread, each against the same offline run; --interleave --repeats 2: a fresh server per
    repeat, the second repeat in the reverse order."""
    turns = ["Name a state space model.", "Mamba2 is one."]
    args = ["--conv-backends", "1", "--engine-process", "1,0", "--runs", "4@inf:1"]
    args += ["--offline", "4:1", "--repeats", "2", "--interleave"]
    args += ["--server-args", "--load-format dummy --max-num-seqs 2 --max-model-len 128"]
    out, runs = run_sweep(tmp_path, turns, args)
    order = [n for n in runs if n.startswith("server ")]
    assert order == [f"server conv1_{m}-r{i}" for m, i in
                     (("proc", 0), ("thread", 0), ("thread", 1), ("proc", 1))]  # fmt: skip
    for mode, value in (("proc", "1"), ("thread", "0")):
        for i in (0, 1):
            assert runs[f"server conv1_{mode}-r{i}"]["engine_process"] == value
            assert runs[f"server conv1_{mode}-r{i}"]["exit_status"] == 0
            res = json.loads((out / f"conv1_{mode}-4-rateinf-r{i}.json").read_text())
            assert (res["completed"], res["total_output_tokens"]) == (1, 4)
            assert res["conv_backend"] == f"triton/{mode}" and res["engine_process"] == mode
            assert res["repeat"] == str(i)
            log = (out / f"server-conv1_{mode}-r{i}.log").read_text()
            assert ("the engine core runs in process" in log) == (mode == "proc"), log
    md = (out / "sweep.md").read_text()
    for mode in ("proc", "thread"):
        assert f"| conv1_{mode}-4-rateinf | 2 | " in md  # the repeats' spread
        assert f"- conv1_{mode}-4-rateinf vs offline-conv1-4: server / offline" in md

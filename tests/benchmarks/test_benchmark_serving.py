"""vllm/benchmarks/serve.py against a live tiny `vllm serve` (a real server process over real HTTP,
the real tokenizer of tests/tiny_model.py): the random data set through `vllm bench serve`
and a ShareGPT sample (truncated on purpose, one prompt longer than the server's
--max-model-len) through the chat backend; the result JSON's keys and counts, the refused
request counted as failed with the server's reason; then plot_serving.py
(benchmarks/serving/) on both results.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.utils import serve_for_module, server_env
from tests.tiny_model import make_tiny_model_dir
from tests.utils import REPO
from vllm.benchmarks.datasets import read_sharegpt, sample_sharegpt
from vllm.benchmarks.metrics import DETAILED_KEYS

MAX_MODEL_LEN = 96
OUTPUT_LEN = 4
# vLLM's result keys (benchmark_serving's JSON), and the per-request lists of --save-detailed.
UPSTREAM_KEYS = {
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
}
METRIC_KEYS = {
    f"{stat}_{m}_ms"
    for m in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p50", "p99")
}
SHORT_PROMPTS = [
    "What is a state space model?",
    "Write a haiku about a fast server.",
    "Why is the sky blue? Answer in one line.",
    "Name three prime numbers.",
    "How do I reverse a list in Python?",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # One layer: the benchmark's results are checked, not the model (half the steps' work).
    return make_tiny_model_dir(tmp_path_factory.mktemp("bench_tiny"), num_hidden_layers=1)


@pytest.fixture(scope="module")
def server(model_dir):
    args = ["--max-num-seqs", "4", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
    yield from serve_for_module(model_dir, args)


def sharegpt_file(path: Path, tokenizer) -> tuple[Path, str]:
    """Five short conversations, one whose prompt the server must refuse, a one-turn record,
    and a broken tail; the long prompt is not the first sampled (the test request)."""
    long_prompt = "Explain every step of the scan kernel in detail. " * 12
    assert MAX_MODEL_LEN < len(tokenizer(long_prompt).input_ids) <= 1024  # sampled, refused
    records = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": p},
                {"from": "gpt", "value": "Sure, here it is."},
            ],
        }
        for i, p in enumerate([*SHORT_PROMPTS, long_prompt])
    ]
    records.append({"id": "one-turn", "conversations": [{"from": "human", "value": "alone"}]})
    text = json.dumps(records, indent=1)
    path.write_text(text + ',\n {"id": "cut", "conversations": [{"from": "human", "val')
    return path, long_prompt


@pytest.fixture(scope="module")
def results(server, model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("results")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # The random data set through the vllm CLI, as a user runs it.
    common = ["--base-url", server.base_url, "--model", str(model_dir), "--ignore-eos"]
    common += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    common += ["--save-result", "--result-dir", str(out), "--disable-tqdm"]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *common]
    cmd += ["--dataset-name", "random", "--random-input-len", "12"]
    cmd += ["--random-output-len", str(OUTPUT_LEN), "--num-prompts", "4", "--save-detailed"]
    cmd += ["--result-filename", "random.json", "--metadata", "conv_backend=triton"]
    proc = subprocess.run(cmd, cwd=REPO, env=server_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr + server.log()
    # A ShareGPT sample through the chat backend, in-process.
    path, long_prompt = sharegpt_file(out / "sample.json", tokenizer)
    from vllm.benchmarks.serve import cli

    chat = cli(
        [
            *common,
            "--backend",
            "openai-chat",
            "--dataset-name",
            "sharegpt",
            "--dataset-path",
            str(path),
            "--sharegpt-output-len",
            str(OUTPUT_LEN),
            "--num-prompts",
            "10",
            "--result-filename",
            "chat.json",
            "--metadata",
            "conv_backend=triton-chat",
        ]
    )
    sampled = sample_sharegpt(read_sharegpt(path).records, tokenizer, 10, seed=0)
    assert sampled[0].prompt != long_prompt  # the premise: the test request is a short one
    return {
        "out": out,
        "random": json.loads((out / "random.json").read_text()),
        "random_stdout": proc.stdout,
        "chat": json.loads((out / "chat.json").read_text()),
        "chat_returned": chat,
        "sampled": sampled,
        "long_prompt": long_prompt,
    }


def test_random_run_keys_and_counts(results):
    r = results["random"]
    assert UPSTREAM_KEYS | METRIC_KEYS | set(DETAILED_KEYS) | {"failed"} <= set(r)
    assert (r["completed"], r["failed"], r["num_prompts"]) == (4, 0, 4)
    assert r["backend"] == "openai" and r["request_rate"] == "inf"
    assert r["conv_backend"] == "triton" and r["failure_reasons"] == {}
    # --ignore-eos: every request generates exactly its tokens, counted by the server.
    assert r["output_lens"] == [OUTPUT_LEN] * 4 and r["total_output_tokens"] == 4 * OUTPUT_LEN
    assert r["output_tokens_without_usage"] == 0
    assert r["total_input_tokens"] == sum(r["input_lens"]) and all(n >= 12 for n in r["input_lens"])
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert all(t > 0 for t in r["ttfts"]) and all(len(i) <= OUTPUT_LEN - 1 for i in r["itls"])
    assert max(r["ttfts"]) * 1000 == pytest.approx(r["p99_ttft_ms"], rel=0.05)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"]
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["errors"] == [""] * 4 and all(isinstance(t, str) for t in r["generated_texts"])
    assert "Successful requests:" in results["random_stdout"]
    # The client's own time outside the timed run, by piece.
    setup = r["client_setup_s"]
    assert list(setup) == ["imports", "tokenizer", "dataset", "ready_check"]
    assert all(v >= 0 for v in setup.values()) and setup["ready_check"] > 0
    assert "client setup s: imports " in results["random_stdout"]


def test_server_step_stats_of_the_run(results):
    """The server's engine steps over the timed run (its /metrics before and after)."""
    r = results["random"]
    s = r["server_step_stats"]
    assert s["wall_s"] == r["duration"] and "Server engine steps" in results["random_stdout"]
    # Every prompt token was prefilled once; every output token after the first decoded.
    assert s["prefill_tokens"] == r["total_input_tokens"]
    assert s["decode_tokens"] == r["total_output_tokens"] - r["completed"]
    assert 0 < s["num_steps_with_prefill"] <= s["num_steps"]
    assert s["mean_tokens_per_step"] == pytest.approx(
        (s["prefill_tokens"] + s["decode_tokens"]) / s["num_steps"]
    )
    pieces = sum(s["phase_ms_per_step"].values()) * s["num_steps"] / 1e3
    assert pieces == pytest.approx(s["total_step_s"], rel=0.05)
    # The loop's time (steps, waiting, the rest) covers the run's wall time.
    loop = s["total_step_s"] + s["loop_wait_s"] + s["loop_other_s"]
    assert loop == pytest.approx(s["wall_s"], rel=0.2) and 0 < s["share_of_wall_in_steps"] <= 1


def test_sharegpt_chat_run_counts_the_refused_request(results):
    r, sampled = results["chat"], results["sampled"]
    assert len(sampled) == 6  # five short + the long one; the one-turn record and the tail not
    assert (r["num_prompts"], r["completed"], r["failed"]) == (6, 5, 1)
    assert r["backend"] == "openai-chat" and r["dataset_name"] == "sharegpt"
    [(reason, count)] = r["failure_reasons"].items()
    assert count == 1 and "maximum context length" in reason and reason.startswith("HTTP 400")
    assert r["total_output_tokens"] == 5 * OUTPUT_LEN
    short = [s.prompt_len for s in sampled if s.prompt != results["long_prompt"]]
    assert r["total_input_tokens"] == sum(short)  # the client's prompt counts, successes only
    assert not set(DETAILED_KEYS) & set(r)  # no --save-detailed
    assert r == {**results["chat_returned"]}  # the file is what main returned


def _finished_requests(server) -> float:
    """The server's count of requests that ran to their end (every finish reason)."""
    import httpx

    text = httpx.get(server.url_for("metrics"), timeout=30).text
    pattern = r"^vllm:request_success_total\{[^}]*\} (\S+)$"
    return sum(float(m) for m in re.findall(pattern, text, re.M))


def _quick_run(url: str, model_dir, out: Path, name: str, *extra: str) -> dict:
    from vllm.benchmarks.serve import cli

    args = ["--base-url", url, "--model", str(model_dir), "--dataset-name", "random"]
    args += ["--random-output-len", "2", "--num-prompts", "2", "--disable-tqdm"]
    args += ["--ready-check-timeout-sec", "0", "--save-result", "--result-dir", str(out)]
    record = cli([*args, "--result-filename", name, *extra])
    assert json.loads((out / name).read_text()) == record  # written, whatever the outcome
    return record


def test_ready_check_timeout_0_sends_no_test_request(server, model_dir, tmp_path):
    """As vLLM's: 0 skips the test request; the server sees the run's two requests only."""
    before = _finished_requests(server)
    r = _quick_run(server.base_url, model_dir, tmp_path, "ok.json", "--random-input-len", "8")
    assert (r["completed"], r["failed"]) == (2, 0)
    assert _finished_requests(server) - before == 2
    assert r["client_setup_s"]["ready_check"] == 0


def test_refused_requests_are_failures_in_the_results(server, model_dir, tmp_path):
    """Requests the server refuses (prompts over its context length: HTTP 400) or that find
    no server (a refused connection) are failed requests with their reasons, and the result
    file is written (no test request stops the run first)."""
    too_long = ["--random-input-len", str(2 * MAX_MODEL_LEN)]
    r = _quick_run(server.base_url, model_dir, tmp_path, "refused.json", *too_long)
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (0, 2, 0)
    [(reason, count)] = r["failure_reasons"].items()
    assert count == 2 and reason.startswith("HTTP 400: ") and "maximum context length" in reason

    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = _quick_run(nobody, model_dir, tmp_path, "no_server.json", "--random-input-len", "8")
    assert (r["completed"], r["failed"]) == (0, 2)
    [(reason, count)] = r["failure_reasons"].items()
    assert count == 2 and reason.startswith("ClientConnectorError"), reason
    assert "server_step_stats" not in r


def test_plot_and_table_from_the_results(results, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib (requirements/bench.txt) is absent")
    from benchmarks.serving.plot_serving import main

    png, md = tmp_path / "serving.png", tmp_path / "serving.md"
    main(
        [
            str(results["out"] / "random.json"),
            str(results["out"] / "chat.json"),
            "--out",
            str(png),
            "--md",
            str(md),
        ]
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = md.read_text().splitlines()
    assert len(rows) == 4  # header, rule, two results
    assert any("| triton-chat | inf | 6 | 5 | 1 |" in row for row in rows)

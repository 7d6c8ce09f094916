"""The server's other endpoints (models, health, version, tokenizer, metrics), API-key auth,
the ``vllm`` console script, and SIGTERM with a stream in flight."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

import vllm
from tests.entrypoints.utils import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    SERVER_ARGS,
    RemoteServer,
    assert_error_body,
    assert_serves,
    iter_sse,
)

pytestmark = pytest.mark.timeout(300)


def test_models(client, server, tiny_model_dir):
    [card] = client.models.list().data
    assert card.id == MODEL_NAME and card.owned_by == "vllm"
    raw = httpx.get(server.url_for("v1", "models"), timeout=30).json()
    assert raw["object"] == "list"
    assert raw["data"][0]["root"] == str(tiny_model_dir)
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_health_and_version(server):
    assert httpx.get(server.url_for("health"), timeout=30).status_code == 200
    r = httpx.get(server.url_for("version"), timeout=30)
    assert r.status_code == 200 and r.json() == {"version": vllm.__version__}


def test_tokenize_and_detokenize(server):
    r = httpx.post(server.url_for("tokenize"), json={"prompt": "hello world"}, timeout=30)
    out = r.json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    assert out["tokens"][0] == 1  # BOS
    plain = httpx.post(
        server.url_for("tokenize"),
        json={"prompt": "hello world", "add_special_tokens": False},
        timeout=30,
    ).json()
    assert plain["tokens"] == out["tokens"][1:]
    back = httpx.post(server.url_for("detokenize"), json={"tokens": out["tokens"]}, timeout=30)
    assert back.json() == {"prompt": "hello world"}  # special tokens are not shown
    chat = httpx.post(
        server.url_for("tokenize"),
        json={"messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    ).json()
    text = httpx.post(server.url_for("detokenize"), json={"tokens": chat["tokens"]}, timeout=30)
    assert text.json()["prompt"] == "user\nhi\nassistant\n"  # ChatML with its markers hidden


def _scrape(server) -> dict[str, float]:
    """Every sample of /metrics for our model, keyed by name and other labels, summed over
    the step series' ``execution`` label (graph / eager)."""
    text = httpx.get(server.url_for("metrics"), timeout=30).text
    samples = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z0-9_]+)\{(.*)\} (\S+)$", line)
        if m and f'model_name="{MODEL_NAME}"' in m.group(2):
            drop = ("model_name=", "execution=")
            labels = ",".join(p for p in m.group(2).split(",") if not p.startswith(drop))
            key = m.group(1) + (f"{{{labels}}}" if labels else "")
            samples[key] = samples.get(key, 0.0) + float(m.group(3))
    return samples


def _scrape_once_recorded(server, before: dict[str, float], num_requests: int):
    """/metrics once the engine has recorded ``num_requests`` more finished requests than
    ``before`` shows (it records a step's stats right after handing out its outputs: the
    last step's may land a moment after the last response; at most 5 s), and ``delta``:
    a sample's change since ``before``."""

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    deadline = time.monotonic() + 5
    after = _scrape(server)
    while delta("vllm:e2e_request_latency_seconds_count") < num_requests:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
        after = _scrape(server)
    return after, delta


KINDS = ("prefill", "decode")


def test_metrics_count_what_was_sent(server, client):
    before = _scrape(server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    prompt_tokens = generated = 0
    lengths = [1, 3, 5]
    for max_tokens in lengths:
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=f"count {max_tokens} tokens",
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        prompt_tokens += out.usage.prompt_tokens
        generated += out.usage.completion_tokens
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt_tokens += chat.usage.prompt_tokens
    generated += chat.usage.completion_tokens

    after, delta = _scrape_once_recorded(server, before, 4)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens
    assert delta("vllm:generation_tokens_total") == generated == sum(lengths) + 2
    assert delta('vllm:request_success_total{finished_reason="length"}') == 4
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    # One latency per token after each request's first.
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 4
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0

    # Engine steps: every prompt token prefilled once, every later token one decode.
    assert delta('vllm:engine_step_tokens_total{token_kind="prefill"}') == prompt_tokens
    assert delta('vllm:engine_step_tokens_total{token_kind="decode"}') == generated - 4
    assert delta("vllm:iteration_tokens_total_sum") == prompt_tokens + generated - 4
    steps = sum(delta(f'vllm:engine_step_seconds_count{{step_kind="{k}"}}') for k in KINDS)
    assert steps == delta("vllm:iteration_tokens_total_count") >= 4
    assert delta('vllm:engine_step_seconds_count{step_kind="prefill"}') >= 4
    step_s = sum(delta(f'vllm:engine_step_seconds_sum{{step_kind="{k}"}}') for k in KINDS)
    assert step_s > 0 and delta('vllm:engine_loop_seconds_total{phase="step"}') == (
        pytest.approx(step_s)
    )
    phases = ("schedule", "dispatch", "read")
    pieces = sum(delta(f'vllm:engine_step_phase_seconds_total{{phase="{p}"}}') for p in phases)
    assert 0 < pieces <= step_s
    # The engine core runs in its own process (the default), so a step's time is the
    # core's: its output processing, in the server's process beside the core's next step,
    # is left out of the pieces above and recorded all the same.
    output_s = delta('vllm:engine_step_phase_seconds_total{phase="output"}')
    assert output_s > 0
    # Between the requests the loop waited for work; its other time is exported too.
    assert delta('vllm:engine_loop_seconds_total{phase="wait"}') > 0
    assert 'vllm:engine_loop_seconds_total{phase="other"}' in after
    assert delta('vllm:engine_loop_seconds_total{phase="other"}') >= 0
    # Every kernel variant was compiled (registered, under the interpreter) at start-up.
    assert "vllm:engine_kernel_compiles_total" in after
    assert delta("vllm:engine_kernel_compiles_total") == 0
    # Device spans come from CUDA events: one per step that read a batch on a GPU (the
    # server's default device where there is one); a CPU engine exports the series, empty.
    device_steps = [f'vllm:engine_step_device_seconds_count{{step_kind="{k}"}}' for k in KINDS]
    assert all(name in after for name in device_steps)
    spans = sum(map(delta, device_steps))
    assert 0 < spans <= steps if torch.cuda.is_available() else spans == 0


@pytest.fixture(scope="module")
def auth_server(tiny_model_dir):
    with RemoteServer(tiny_model_dir, SERVER_ARGS, api_key="sesame") as remote:
        yield remote


@pytest.mark.parametrize("header", [None, "Bearer wrong", "sesame", "Basic sesame"])
def test_api_key_required_on_v1(auth_server, header):
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("GET", "v1/models"), ("POST", "v1/completions")):
        r = httpx.request(
            method,
            auth_server.url_for(*path.split("/")),
            json={"prompt": "x", "max_tokens": 1},
            headers=headers,
            timeout=30,
        )
        assert_error_body(r, 401, "AuthenticationError")
    # Probes and scrapers need no key.
    assert httpx.get(auth_server.url_for("health"), timeout=30).status_code == 200
    assert httpx.get(auth_server.url_for("metrics"), timeout=30).status_code == 200


def test_api_key_accepted(auth_server):
    client = auth_server.openai_client()
    assert client.models.list().data[0].id == MODEL_NAME
    assert_serves(auth_server)
    wrong = openai.OpenAI(base_url=auth_server.url_for("v1"), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_vllm_help_lists_serve():
    exe = Path(sys.executable).parent / "vllm"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and re.search(r"^\s+serve\s", out.stdout, re.M), out.stdout
    out = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    for option in ("--port", "--api-key", "--max-num-seqs", "--max-model-len", "--load-format"):
        assert option in out.stdout, option


def test_vllm_serve_refuses_a_negative_long_prefill_token_threshold(tiny_model_dir):
    """A bad engine option stops ``vllm serve`` at start-up, before it listens: a non-zero
    exit and the option's message (checked before any weight is loaded: seconds)."""
    exe = Path(sys.executable).parent / "vllm"
    cmd = [exe, "serve", str(tiny_model_dir), "--long-prefill-token-threshold", "-1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "long_prefill_token_threshold must be >= 0 (0: off), got -1" in out.stderr, out.stderr


def test_vllm_serve_stops_on_sigterm_with_requests_in_flight(tiny_model_dir):
    """Started by the console script; SIGTERM while a long stream and a long non-streaming
    request run: after the graceful timeout both are told the server is shutting down (an
    error event then [DONE]; a 503 body), the process exits 0 within seconds, and the port
    is closed."""
    # A context long enough that neither request can finish before the shutdown, even on a
    # GPU (a Mamba's state does not grow with it).
    extra = ["--timeout-graceful-shutdown", "1", "--max-model-len", "65536"]
    server = RemoteServer(tiny_model_dir, [*SERVER_ARGS, *extra], console_script=True)
    server.start()
    try:
        body = {"model": MODEL_NAME, "prompt": "a long answer", "max_tokens": 60000,
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        url = server.url_for("v1", "completions")
        first_chunk = threading.Event()
        events: list[str] = []
        whole: list[httpx.Response] = []

        def stream():
            try:
                with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                    for event in iter_sse(r):
                        events.append(event)
                        first_chunk.set()
            finally:
                first_chunk.set()

        readers = [
            threading.Thread(target=stream),
            threading.Thread(target=lambda: whole.append(httpx.post(url, json=body, timeout=60))),
        ]
        for reader in readers:
            reader.start()
        assert first_chunk.wait(60) and events, server.log()
        start = time.monotonic()
        server.terminate()
        status = server.wait(timeout=30)
        took = time.monotonic() - start
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive()
        assert status == 0, server.log()
        assert took < 10, (took, server.log())
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], events[-2]
        [response] = whole
        assert_error_body(response, 503, "ServiceUnavailableError")
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url_for("health"), timeout=5)
    finally:
        server.kill()


def test_vllm_serve_takes_long_prefill_token_threshold(client, tiny_model_dir):
    """``vllm serve --long-prefill-token-threshold 4``: the prompt is prefilled 4 tokens a
    step (the step counts of /metrics), and the greedy text equals the default server's."""
    body = dict(
        model=MODEL_NAME,
        prompt="the state space model reads a long prompt in chunks of four tokens",
        max_tokens=3,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    ref = client.completions.create(**body)
    args = [*SERVER_ARGS, "--long-prefill-token-threshold", "4"]
    with RemoteServer(tiny_model_dir, args, console_script=True) as capped:
        before = _scrape(capped)
        out = capped.openai_client().completions.create(**body)
        _, delta = _scrape_once_recorded(capped, before, 1)
    assert out.choices[0].text == ref.choices[0].text
    n = out.usage.prompt_tokens
    assert n > 8 and n % 4 != 1, n  # (a one-token last chunk would run as a decode row)
    assert delta('vllm:engine_step_tokens_total{token_kind="prefill"}') == n
    # ceil(n / 4) batches with prompt tokens; under async scheduling the call that
    # dispatches the first decode waits on the last of them, so it counts as one too.
    assert delta('vllm:engine_step_seconds_count{step_kind="prefill"}') == -(-n // 4) + 1

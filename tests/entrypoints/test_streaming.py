"""Streaming completions against a real server: SSE framing, deltas that add up to the whole
answer, the first token sent before the last exists, 16 concurrent clients over 4 slots
(texts equal to offline ``LLM.generate``), and clients that leave mid-stream."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import torch

from tests.entrypoints.utils import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_NAME,
    assert_serves,
    iter_sse,
    stream_post,
)

pytestmark = pytest.mark.timeout(600)

PROMPT = "Mamba2 streams tokens"


def completion_chunks(server, **body) -> list[dict]:
    events = stream_post(server, "v1/completions", {"model": MODEL_NAME, **body, "stream": True})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def test_stream_adds_up_to_the_whole_answer(server):
    body = dict(prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
    r = httpx.post(server.url_for("v1", "completions"), json={"model": MODEL_NAME, **body})
    whole = r.json()["choices"][0]
    chunks = completion_chunks(server, **body, stream_options={"include_usage": True})
    *deltas, usage = chunks
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in deltas) == whole["text"]
    reasons = [c["choices"][0]["finish_reason"] for c in deltas]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage["choices"] == [] and usage["usage"] == r.json()["usage"]
    assert all(c["usage"] is None for c in deltas)


def test_stream_through_the_openai_client(client):
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)


def test_stream_echo_and_logprobs(server):
    body = dict(prompt=PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True)
    whole = httpx.post(
        server.url_for("v1", "completions"),
        json={"model": MODEL_NAME, **body, "echo": True, "logprobs": 2},
        timeout=60,
    ).json()["choices"][0]
    chunks = completion_chunks(server, **body, echo=True, logprobs=2)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


def test_first_chunk_comes_before_the_last_token(server):
    """Tokens go out as they are made, not when the request ends."""
    # Long enough that a step outlasts the HTTP overheads: 24 interpreted steps on the CPU,
    # 200 fast ones on a GPU.
    max_tokens = 200 if torch.cuda.is_available() else 24
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    start = time.monotonic()
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=120) as r:
        arrivals = [time.monotonic() - start for _ in iter_sse(r)]
    first, last = arrivals[0], arrivals[-1]
    # Sequential steps: the first chunk must arrive well within the first half.
    assert first < last / 2, (first, last)


def _offline_texts(model_dir, prompts, max_tokens) -> list[str]:
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


async def _stream_one(client, prompt: str, max_tokens: int) -> tuple[str, int]:
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return "".join(text), usage


def test_16_concurrent_streams_over_4_slots_equal_offline(server, tiny_model_dir):
    # Four times the slots: most streams wait in the queue while others run.
    prompts = [f"request {i}: the scan of chunk {i * 7 % 13}" for i in range(16)]
    max_tokens = 5

    async def run_all():
        client = server.async_openai_client(timeout=300)
        try:
            return await asyncio.gather(*(_stream_one(client, p, max_tokens) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert [n for _, n in results] == [max_tokens] * len(prompts)
    assert [t for t, _ in results] == _offline_texts(tiny_model_dir, prompts, max_tokens)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url_for("metrics"), timeout=30).text
    match = re.search(rf'^{re.escape(name)}\{{model_name="{MODEL_NAME}"\}} (\S+)$', text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_disconnects_mid_stream_free_their_slots(server):
    """Six clients that each leave after 2 chunks of a long request: their requests are
    aborted (the fifth and sixth could not even start otherwise, with 4 slots), nothing is
    left running, and a full batch of 4 then completes."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip

    async def leave_after_two(client: httpx.AsyncClient) -> int:
        got = 0
        async with client.stream("POST", server.url_for("v1", "completions"), json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break  # leaving the block closes the connection mid-stream
        return got

    async def full_batch(client: httpx.AsyncClient) -> list[dict]:
        short = {**body, "max_tokens": 3, "stream": False}
        rs = await asyncio.gather(
            *(client.post(server.url_for("v1", "completions"), json=short) for _ in range(4))
        )
        return [r.json() for r in rs]

    async def run():
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            generated = _metric(server, "vllm:generation_tokens_total")
            got = await asyncio.wait_for(
                asyncio.gather(*(leave_after_two(client) for _ in range(6))), timeout=120
            )
            assert got == [2] * 6
            deadline = time.monotonic() + 20
            while _metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert _metric(server, "vllm:num_requests_running") == 0
            assert _metric(server, "vllm:num_requests_waiting") == 0
            # Aborted, not run to their 200 tokens (whatever the device's speed).
            assert _metric(server, "vllm:generation_tokens_total") - generated < 6 * 100
            return await asyncio.wait_for(full_batch(client), timeout=120)

    outs = asyncio.run(run())
    assert [o["usage"]["completion_tokens"] for o in outs] == [3] * 4
    assert _metric(server, "vllm:num_requests_running") == 0
    assert_serves(server)


def test_a_non_streaming_client_that_leaves_aborts_its_request(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    generated = _metric(server, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url_for("v1", "completions"), json=body, timeout=2.0)
    deadline = time.monotonic() + 20
    while _metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server, "vllm:num_requests_running") == 0
    # Aborted, not run to its end (on any device: the count does not depend on speed).
    assert _metric(server, "vllm:generation_tokens_total") - generated < 100
    assert_serves(server)

"""usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details, vLLM's option)
on a real server with prefix caching: a second turn whose prompt is the first turn's prompt
+ its answer + more reports the prompt tokens the engine restored (the server's
vllm:prefix_cache_hits_total grows by as many), in the non-streaming usage and in the final
usage chunk of a stream; without the option the field is not in the JSON."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.utils import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    SERVER_ARGS,
    RemoteServer,
    stream_post,
)

pytestmark = pytest.mark.timeout(300)
CACHE_ARGS = [*SERVER_ARGS, "--enable-prefix-caching", "--mamba-block-size", "4"]
QUESTION = "what is the state space model and why is the scan fast"
MORE = " and what does the kernel do"
ANSWER_TOKENS = 4


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with RemoteServer(tiny_model_dir, [*CACHE_ARGS, "--enable-prompt-tokens-details"]) as s:
        yield s


def hits_total(server) -> float:
    """The server's vllm:prefix_cache_hits_total (tokens restored so far)."""
    text = httpx.get(server.url_for("metrics"), timeout=30).text
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vllm:prefix_cache_hits_total in /metrics:\n{text}")


def complete(server, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, **kw}
    r = httpx.post(server.url_for("v1", "completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def turn2(tiny_model_dir, tokenizer, server) -> list[int]:
    """Turn 2's token ids: turn 1's prompt + its answer + more text. The answer's ids come
    from the offline engine (the same greedy tokens; the server's text must match them):
    its text alone does not name them (byte tokens all decode to U+FFFD)."""
    from vllm import LLM, SamplingParams

    prompt = tokenizer(QUESTION).input_ids
    llm = LLM(str(tiny_model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    answer = list(out.outputs[0].token_ids)
    del llm
    before = hits_total(server)
    one = complete(server, prompt, ignore_eos=True, max_tokens=ANSWER_TOKENS)
    assert one["choices"][0]["text"] == out.outputs[0].text
    # A new prompt: nothing restored, and the field says 0.
    assert one["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert hits_total(server) == before
    return prompt + answer + tokenizer(MORE, add_special_tokens=False).input_ids


def test_second_turn_reports_restored_tokens(server, turn2, tokenizer):
    before = hits_total(server)
    two = complete(server, turn2)
    restored = hits_total(server) - before
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached == restored
    assert set(two["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    assert two["usage"]["prompt_tokens"] == len(turn2) > cached
    # Several prompts: the usage sums what each restored (turn 2 again, and a new prompt).
    other = tokenizer("hello there", add_special_tokens=False).input_ids
    before = hits_total(server)
    both = complete(server, [turn2, other])
    assert both["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert hits_total(server) - before == cached
    assert both["usage"]["prompt_tokens"] == len(turn2) + len(other)


def test_stream_final_usage_chunk_carries_cached_tokens(server, turn2):
    before = hits_total(server)
    body = {
        "prompt": turn2,
        "max_tokens": 2,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payloads = stream_post(server, "v1/completions", body)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == len(turn2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == hits_total(server) - before > 0
    assert all(c.get("usage") is None for c in chunks[:-1])


def test_chat_usage_has_the_details(server):
    """Chat: the field is there (the rendered prompt of a new conversation: nothing cached)
    in the response and the stream's final usage chunk."""
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    r = httpx.post(server.url_for("v1", "chat", "completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    body.update(stream=True, stream_options={"include_usage": True})
    payloads = stream_post(server, "v1/chat/completions", body)
    usage = json.loads(payloads[-2])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_absent_without_the_option(tiny_model_dir, tokenizer):
    with RemoteServer(tiny_model_dir, CACHE_ARGS) as plain:
        usage = complete(plain, tokenizer(QUESTION).input_ids)["usage"]
        assert "prompt_tokens_details" not in usage
        body = {
            "prompt": "hello",
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        payloads = stream_post(plain, "v1/completions", body)
        assert "prompt_tokens_details" not in json.loads(payloads[-2])["usage"]

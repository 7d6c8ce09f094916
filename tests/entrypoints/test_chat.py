"""POST /v1/chat/completions against a real server: the chat template, streaming deltas,
logprobs in chat format, default and explicit lengths, and a model without a template."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.entrypoints.utils import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    SERVER_ARGS,
    RemoteServer,
    assert_error_body,
    assert_serves,
    stream_post,
)

pytestmark = pytest.mark.timeout(300)

MESSAGES = [
    {"role": "system", "content": "You are a tiny model."},
    {"role": "user", "content": "What is a state space model?"},
]


def chat_prompt_tokens(server, messages) -> list[int]:
    r = httpx.post(server.url_for("tokenize"), json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_completion_through_the_openai_client(client, server):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    # The template's rendering, tokenized without a second BOS, is what the model read.
    tokens = chat_prompt_tokens(server, MESSAGES)
    assert tokens[0] == 1 and tokens.count(1) == 1
    assert out.usage.prompt_tokens == len(tokens)
    assert out.usage.completion_tokens == 5


def test_stream_role_first_then_content_then_done(server, client):
    body = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0.0)
    whole = client.chat.completions.create(**body, extra_body={"ignore_eos": True})
    body["ignore_eos"] = True
    events = stream_post(server, "v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    first, rest = chunks[0], chunks[1:]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["delta"].get("content", "") == ""
    assert all("role" not in c["choices"][0]["delta"] for c in rest)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in rest)
    assert text == whole.choices[0].message.content
    reasons = [c["choices"][0]["finish_reason"] for c in rest]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])


def test_stream_usage_and_n_choices(server):
    body = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=3,
        temperature=1.0,
        seed=3,
        n=2,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [json.loads(e) for e in stream_post(server, "v1/chat/completions", body)[:-1]]
    *content, last = chunks
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": len(chat_prompt_tokens(server, MESSAGES)),
        "completion_tokens": 6,
        "total_tokens": len(chat_prompt_tokens(server, MESSAGES)) + 6,
    }
    assert all(c["usage"] is None for c in content)  # OpenAI's null until the end
    roles = [c for c in content if c["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(c["choices"][0]["index"] for c in roles) == [0, 1]
    finished = [c["choices"][0]["index"] for c in content if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        alts = [a.logprob for a in entry.top_logprobs]
        assert alts == sorted(alts, reverse=True) and all(v <= 0.0 for v in alts)
        # Greedy: the sampled token is the best alternative.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_default_max_tokens_is_what_the_context_leaves(server):
    """No max_tokens: generation may run to max_model_len (a prompt just short of it)."""
    words = 1
    while True:  # the longest message whose prompt leaves at least 3 tokens
        longer = [{"role": "user", "content": "state " * (words + 1)}]
        if len(chat_prompt_tokens(server, longer)) > MAX_MODEL_LEN - 3:
            break
        words += 1
    long_message = [{"role": "user", "content": "state " * words}]
    num_prompt = len(chat_prompt_tokens(server, long_message))
    assert MAX_MODEL_LEN - 12 < num_prompt <= MAX_MODEL_LEN - 3, num_prompt
    r = httpx.post(
        server.url_for("v1", "chat", "completions"),
        json={"messages": long_message, "temperature": 0.0, "ignore_eos": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == MAX_MODEL_LEN - num_prompt
    assert out["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_wins_over_max_tokens(client):
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=6,
        max_completion_tokens=2,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 2


def test_a_model_without_a_chat_template_refuses_chat(tiny_model_dir_no_template):
    with RemoteServer(tiny_model_dir_no_template, SERVER_ARGS) as server:
        r = httpx.post(
            server.url_for("v1", "chat", "completions"),
            json={"model": MODEL_NAME, "messages": MESSAGES},
            timeout=60,
        )
        error = assert_error_body(r, 400, "BadRequestError")
        assert "chat template" in error["message"]
        with pytest.raises(openai.BadRequestError, match="chat template"):
            server.openai_client().chat.completions.create(model=MODEL_NAME, messages=MESSAGES)
        r = httpx.post(server.url_for("tokenize"), json={"messages": MESSAGES}, timeout=30)
        assert_error_body(r, 400, "BadRequestError")
        assert_serves(server)  # completions need no template

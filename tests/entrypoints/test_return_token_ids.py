"""vLLM's ``return_token_ids`` on /v1/completions and /v1/chat/completions, against a real
server: the prompt's token ids (the tokenizer's encoding, or the ids sent) and each choice's
generated ids, equal to the offline engine's greedy ids; a stream sends every generated id
once, in order (a chunk whose text is still held back too), the prompt's ids in a choice's
first chunk only; without the field the keys are null (whole responses) or absent (streams,
unchanged), and a non-boolean value is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.entrypoints.utils import (
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MODEL_NAME,
    assert_error_body,
    stream_post,
)

pytestmark = pytest.mark.timeout(300)

PROMPT = "the state space model scans the sequence"
IDS = [1, 76, 387, 225, 342, 464, 90, 33]  # a BOS, then ordinary tokens of the tiny vocab
MESSAGES = [{"role": "user", "content": "What is a state space model?"}]
N = 5  # generated tokens per choice
GREEDY = dict(max_tokens=N, temperature=0.0, ignore_eos=True)
# Never in a 5-token answer: the engine holds back this many characters minus one, so
# every chunk before the last has ids but no text yet.
NEVER = "<a stop string that this answer will not contain>"
COMPLETION_KEYS = {"index", "text", "logprobs", "finish_reason", "stop_reason"}
CHAT_KEYS = {"index", "delta", "logprobs", "finish_reason", "stop_reason"}
CHUNK_KEYS = {"id", "object", "created", "model", "choices", "usage"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def offline(tiny_model_dir, tokenizer, chat_ids) -> dict[str, list[int]]:
    """The offline engine's greedy ids for the text prompt, the id prompt and the chat."""
    from vllm import LLM, SamplingParams

    prompts = {"text": tokenizer(PROMPT).input_ids, "ids": IDS, "chat": chat_ids}
    llm = LLM(str(tiny_model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(**GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], params)
    del llm
    return {k: list(o.outputs[0].token_ids) for k, o in zip(prompts, outs, strict=True)}


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(
        server.url_for(*path.split("/")), json={"model": MODEL_NAME, **body}, timeout=120
    )


def ok(server, path: str, **body) -> dict:
    r = post(server, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def chunks(server, path: str, **body) -> list[dict]:
    events = stream_post(server, path, {"model": MODEL_NAME, **body, "stream": True})
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def check_completion_stream(got: list[dict], whole: dict) -> None:
    """Each choice of the stream: its ids in order equal the whole response's, its prompt's
    ids in its first chunk only, its text the same; the usage counts the ids."""
    *deltas, usage = got
    assert usage["choices"] == [] and "token_ids" not in json.dumps(usage)
    for want in whole["choices"]:
        mine = [c["choices"][0] for c in deltas if c["choices"][0]["index"] == want["index"]]
        assert all(set(c) == COMPLETION_KEYS | {"prompt_token_ids", "token_ids"} for c in mine)
        assert mine[0]["prompt_token_ids"] == want["prompt_token_ids"]
        assert all(c["prompt_token_ids"] is None for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert mine[-1]["finish_reason"] == want["finish_reason"]
    total = sum(len(c["token_ids"]) for c in whole["choices"])
    assert usage["usage"]["completion_tokens"] == total == whole["usage"]["completion_tokens"]


def test_completion_of_a_text_prompt(server, tokenizer, offline):
    body = dict(prompt=PROMPT, **GREEDY, return_token_ids=True)
    whole = ok(server, "v1/completions", **body)
    [choice] = whole["choices"]
    assert choice["prompt_token_ids"] == tokenizer(PROMPT).input_ids
    assert choice["token_ids"] == offline["text"]
    assert whole["usage"]["completion_tokens"] == N
    assert whole["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    got = chunks(server, "v1/completions", **body, stream_options={"include_usage": True})
    check_completion_stream(got, whole)


def test_completion_of_id_prompts_and_echo(server, offline):
    body = dict(prompt=[IDS, IDS[:4]], **GREEDY, return_token_ids=True)
    whole = ok(server, "v1/completions", **body)
    first, second = sorted(whole["choices"], key=lambda c: c["index"])
    assert first["prompt_token_ids"] == IDS and second["prompt_token_ids"] == IDS[:4]
    assert first["token_ids"] == offline["ids"] and len(second["token_ids"]) == N
    got = chunks(server, "v1/completions", **body, stream_options={"include_usage": True})
    check_completion_stream(got, whole)
    # Echo: the text starts with the prompt; the ids stay the generated ones.
    echo = ok(server, "v1/completions", prompt=IDS, **GREEDY, return_token_ids=True, echo=True)
    [choice] = echo["choices"]
    assert choice["prompt_token_ids"] == IDS and choice["token_ids"] == offline["ids"]
    assert choice["text"].endswith(first["text"]) and choice["text"] != first["text"]
    got = chunks(
        server, "v1/completions", prompt=IDS, **GREEDY, return_token_ids=True, echo=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    check_completion_stream(got, echo)


def test_a_stream_sends_ids_whose_text_is_held_back(server, offline):
    """A stop string holds the text back until the end: the ids still arrive as made, in
    chunks with no text; without return_token_ids those chunks are not sent (as before)."""
    body = dict(prompt=IDS, **GREEDY, stop=[NEVER])
    whole = ok(server, "v1/completions", **body, return_token_ids=True)
    assert whole["choices"][0]["token_ids"] == offline["ids"]
    got = chunks(server, "v1/completions", **body, return_token_ids=True)
    texts = [c["choices"][0]["text"] for c in got]
    assert texts[:-1] == [""] * (len(got) - 1) and len(got) > 1
    assert [t for c in got for t in c["choices"][0]["token_ids"]] == offline["ids"]
    assert "".join(texts) == whole["choices"][0]["text"]
    plain = chunks(server, "v1/completions", **body)
    assert len(plain) == 1 and plain[0]["choices"][0]["text"] == whole["choices"][0]["text"]
    # Chat too.
    msgs = dict(messages=MESSAGES, **GREEDY, stop=[NEVER])
    got = chunks(server, "v1/chat/completions", **msgs, return_token_ids=True)
    content = [c["choices"][0] for c in got[1:]]  # after the role chunk
    assert len(content) > 1 and all(c["delta"] == {"content": ""} for c in content[:-1])
    assert [t for c in content for t in c["token_ids"]] == offline["chat"]


def test_a_stop_token_is_among_the_ids(server, offline):
    """The id that stopped the choice is the last of its ids, streamed or not."""
    greedy = offline["ids"]
    stop = greedy[2]
    end = greedy.index(stop) + 1
    body = dict(prompt=IDS, max_tokens=N, temperature=0.0, stop_token_ids=[stop])
    whole = ok(server, "v1/completions", **body, return_token_ids=True)
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["token_ids"] == greedy[:end]
    assert whole["usage"]["completion_tokens"] == end
    got = chunks(server, "v1/completions", **body, return_token_ids=True)
    assert [t for c in got for t in c["choices"][0]["token_ids"]] == greedy[:end]


def test_chat(server, chat_ids, offline):
    body = dict(messages=MESSAGES, **GREEDY, return_token_ids=True)
    whole = ok(server, "v1/chat/completions", **body)
    [choice] = whole["choices"]
    # One prompt for every choice: on the response, as vLLM has it.
    assert whole["prompt_token_ids"] == chat_ids
    assert choice["token_ids"] == offline["chat"]
    assert whole["usage"]["completion_tokens"] == N
    got = chunks(server, "v1/chat/completions", **body, stream_options={"include_usage": True})
    role, *deltas, usage = got
    assert role["prompt_token_ids"] == chat_ids and role["choices"][0]["token_ids"] is None
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["prompt_token_ids"] is None for c in deltas)
    assert [t for c in deltas for t in c["choices"][0]["token_ids"]] == offline["chat"]
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in deltas)
        == (choice["message"]["content"])
    )
    assert usage["usage"]["completion_tokens"] == N and "prompt_token_ids" not in usage


def test_chat_stream_of_several_choices(server, chat_ids):
    """n choices: each one's role chunk carries the prompt's ids; each one's ids add up to
    the whole response's (the same seed)."""
    body = dict(messages=MESSAGES, max_tokens=3, n=2, temperature=1.0, seed=11)
    whole = ok(server, "v1/chat/completions", **body, return_token_ids=True)
    got = chunks(server, "v1/chat/completions", **body, return_token_ids=True)
    for want in whole["choices"]:
        mine = [c for c in got if c["choices"][0]["index"] == want["index"]]
        assert mine[0]["prompt_token_ids"] == chat_ids
        assert all(c["prompt_token_ids"] is None for c in mine[1:])
        assert [t for c in mine[1:] for t in c["choices"][0]["token_ids"]] == want["token_ids"]


def test_off_by_default(server):
    for extra in ({}, {"return_token_ids": False}, {"return_token_ids": None}):
        out = ok(server, "v1/completions", prompt=IDS, max_tokens=2, **extra)
        [choice] = out["choices"]
        assert choice["prompt_token_ids"] is None and choice["token_ids"] is None
        out = ok(server, "v1/chat/completions", messages=MESSAGES, max_tokens=2, **extra)
        assert out["prompt_token_ids"] is None and out["choices"][0]["token_ids"] is None
    # Streams are as they were: no such keys at all.
    got = chunks(server, "v1/completions", prompt=IDS, max_tokens=2)
    assert all(set(c) == CHUNK_KEYS for c in got)
    assert all(set(c["choices"][0]) == COMPLETION_KEYS for c in got)
    got = chunks(server, "v1/chat/completions", messages=MESSAGES, max_tokens=2)
    assert all(set(c) == CHUNK_KEYS - {"usage"} for c in got)
    assert all(set(c["choices"][0]) == CHAT_KEYS for c in got)


def test_through_the_openai_client(client, chat_ids):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0.0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert out.prompt_token_ids == chat_ids and len(out.choices[0].token_ids) == 2
    out = client.completions.create(
        model=MODEL_NAME, prompt=IDS, max_tokens=2, extra_body={"return_token_ids": True}
    )
    assert out.choices[0].prompt_token_ids == IDS and len(out.choices[0].token_ids) == 2


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_a_non_boolean_is_refused(server, value):
    for path, body in (
        ("v1/completions", dict(prompt=IDS, max_tokens=1)),
        ("v1/chat/completions", dict(messages=MESSAGES, max_tokens=1)),
    ):
        r = post(server, path, **body, return_token_ids=value)
        error = assert_error_body(r, 400, "BadRequestError")
        assert error["param"] == "return_token_ids" and "return_token_ids" in error["message"]


def test_refusals_and_a_disconnect_leave_the_server_serving(server, offline):
    """After the 400s above and a client that drops a return_token_ids stream after its
    first chunk, the next request is served whole, with the offline engine's ids."""
    for value in ("yes", 1):
        assert post(server, "v1/completions", prompt=IDS, return_token_ids=value).status_code == 400
    body = {"model": MODEL_NAME, "prompt": IDS, "max_tokens": 64, "stream": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # one event, then the connection closes
    out = ok(server, "v1/completions", prompt=IDS, return_token_ids=True, **GREEDY)
    assert out["choices"][0]["token_ids"] == offline["ids"]

"""/v1/completions with echo and logprobs over the prompt, against a real server: the request
lm-eval's local-completions sends to score a loglikelihood (``{prompt: [ids...], max_tokens:
1, logprobs: 1, echo: true, temperature: 0}``) and its edge cases, vLLM's ``max_tokens: 0``
echo among them."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.utils import MAX_MODEL_LEN, MODEL_NAME, assert_error_body, stream_post

pytestmark = pytest.mark.timeout(300)

IDS = [1, 76, 387, 225, 342, 464, 90, 33]  # a BOS, then ordinary tokens of the tiny vocab


def post(server, **body) -> httpx.Response:
    return httpx.post(
        server.url_for("v1", "completions"), json={"model": MODEL_NAME, **body}, timeout=120
    )


def complete(server, **body) -> dict:
    r = post(server, **body)
    assert r.status_code == 200, r.text
    return r.json()


def score(server, prompt, **body) -> dict:
    """lm-eval's loglikelihood request."""
    defaults = dict(max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    return complete(server, prompt=prompt, **{**defaults, **body})


def check_prompt_positions(lp: dict, n: int, k: int) -> None:
    """The first n positions of an echo: None first, then each prompt token's logprob, found
    among its alternatives (the k best, and the token itself when it is not one of them)."""
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, n):
        value, top = lp["token_logprobs"][pos], lp["top_logprobs"][pos]
        assert value is not None and value <= 0.0
        assert lp["tokens"][pos] in top and top[lp["tokens"][pos]] == value
        assert 1 <= len(top) <= k + 1 and max(top.values()) >= value


def test_lm_evals_loglikelihood_request(server):
    out = score(server, IDS)
    [choice] = out["choices"]
    lp = choice["logprobs"]
    # The prompt's tokens, then the one generated token: lm-eval reads [ctxlen:-1].
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(IDS) + 1
    check_prompt_positions(lp, len(IDS), k=1)
    assert out["usage"] == {"prompt_tokens": len(IDS), "completion_tokens": 1, "total_tokens": 9}
    # The text starts with the prompt's tokens (the BOS echoes as "", as the server decodes
    # it); each offset is where its token's text starts.
    assert choice["text"].startswith("".join(lp["tokens"][: len(IDS)]))
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(IDS) + 1)]


def test_a_prompt_logprob_is_the_logprob_of_generating_that_token(server):
    """Position i of an echo is what the model gives token i after the tokens before it:
    the same number as generating it greedily from that prefix."""
    prefix = IDS[:5]
    gen = complete(server, prompt=prefix, max_tokens=1, temperature=0, logprobs=1)
    [choice] = gen["choices"]
    token = choice["logprobs"]["tokens"][0]
    greedy_id = httpx.post(
        server.url_for("tokenize"), json={"prompt": token, "add_special_tokens": False}
    ).json()["tokens"]
    if len(greedy_id) != 1:
        pytest.fail(f"the greedy token {token!r} does not round-trip through /tokenize")
    echoed = score(server, prefix + greedy_id)["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][len(prefix)] == pytest.approx(
        choice["logprobs"]["token_logprobs"][0], abs=1e-4
    )
    # Greedy: the token is its position's best, which lm-eval's is_greedy checks.
    top = echoed["top_logprobs"][len(prefix)]
    assert echoed["token_logprobs"][len(prefix)] == max(top.values())


def test_a_batch_of_token_prompts_keeps_its_order(server):
    prompts = [IDS, IDS[:3], IDS[:1], IDS[2:]]
    out = score(server, prompts)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    alone = [score(server, p)["choices"][0]["logprobs"]["token_logprobs"] for p in prompts]
    for prompt, choice, want in zip(prompts, choices, alone, strict=True):
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(prompt) + 1
        assert got[: len(prompt)] == pytest.approx(want[: len(prompt)], abs=1e-4, nan_ok=False)


def test_a_one_token_prompt_has_no_prompt_logprob(server):
    lp = score(server, [1])["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1] <= 0.0


def test_more_alternatives_per_prompt_token(server):
    lp = score(server, IDS, logprobs=5)["choices"][0]["logprobs"]
    check_prompt_positions(lp, len(IDS), k=5)
    assert any(len(top) >= 5 for top in lp["top_logprobs"][1:])


def test_echo_with_max_tokens_zero_returns_the_scored_prompt_only(server):
    out = score(server, IDS, max_tokens=0)
    [choice] = out["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(IDS)
    with_one = score(server, IDS)["choices"][0]
    assert lp["token_logprobs"] == with_one["logprobs"]["token_logprobs"][:-1]
    assert choice["text"] == "".join(lp["tokens"])
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert out["usage"]["completion_tokens"] == 0
    # Text prompts too: the echo is the prompt text itself.
    text = complete(server, prompt="Hello there", max_tokens=0, echo=True)["choices"][0]
    assert text["text"] == "Hello there" and text["logprobs"] is None


def test_echo_with_max_tokens_zero_streams_the_prompt_then_the_end(server):
    body = dict(model=MODEL_NAME, prompt=IDS, max_tokens=0, echo=True, logprobs=1, stream=True)
    events = stream_post(server, "v1/completions", body)
    assert events[-1] == "[DONE]"
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in choices) == "".join(
        t for c in choices for t in c["logprobs"]["tokens"]
    )
    assert sum(len(c["logprobs"]["tokens"]) for c in choices) == len(IDS)
    assert choices[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_max_tokens_zero_without_echo_is_refused(server):
    error = assert_error_body(post(server, prompt=IDS, max_tokens=0), 400, "BadRequestError")
    assert error["param"] == "max_tokens" and "echo" in error["message"]
    error = assert_error_body(post(server, prompt=IDS, max_tokens=-1), 400, "BadRequestError")
    assert error["param"] == "max_tokens"


def test_an_echo_needs_room_for_its_one_token(server):
    longest = [1] + [76] * (MAX_MODEL_LEN - 2)  # MAX_MODEL_LEN - 1 tokens: fits with one
    lp = score(server, longest, max_tokens=0)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == MAX_MODEL_LEN - 1
    error = assert_error_body(
        post(server, prompt=longest + [76], max_tokens=0, echo=True), 400, "BadRequestError"
    )
    assert "maximum context length" in error["message"]

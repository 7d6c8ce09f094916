"""POST /v1/completions against a real server: prompt forms, batches, n, stops, logprobs, echo
and usage, through the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.utils import MAX_MODEL_LEN, MAX_NUM_SEQS, MODEL_NAME

pytestmark = pytest.mark.timeout(300)

PROMPT = "The state space model"


def complete(server, **body) -> dict:
    r = httpx.post(
        server.url_for("v1", "completions"), json={"model": MODEL_NAME, **body}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(server, text: str, add_special_tokens: bool = True) -> list[int]:
    body = {"prompt": text, "add_special_tokens": add_special_tokens}
    r = httpx.post(server.url_for("tokenize"), json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_string_prompt_through_the_openai_client(client, server):
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.model == MODEL_NAME
    assert out.id.startswith("cmpl-")
    [choice] = out.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    prompt_ids = tokenize(server, PROMPT)
    assert prompt_ids[0] == 1  # the tokenizer's BOS: completions add special tokens
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == len(prompt_ids) + 5


def test_greedy_is_deterministic_and_ids_equal_text(server):
    body = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    by_text = complete(server, prompt=PROMPT, **body)
    again = complete(server, prompt=PROMPT, **body)
    by_ids = complete(server, prompt=tokenize(server, PROMPT), **body)
    assert by_text["choices"][0]["text"] == again["choices"][0]["text"]
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"] == by_text["usage"]


def test_batch_of_strings_and_of_ids(server):
    prompts = ["one two three", "hello world", "def scan(x):"]
    body = dict(max_tokens=3, temperature=0.0, ignore_eos=True)
    singles = [complete(server, prompt=p, **body)["choices"][0]["text"] for p in prompts]
    for batch_prompt in (prompts, [tokenize(server, p) for p in prompts]):
        out = complete(server, prompt=batch_prompt, **body)
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert [c["text"] for c in out["choices"]] == singles
        num_prompt = sum(len(tokenize(server, p)) for p in prompts)
        assert out["usage"] == {
            "prompt_tokens": num_prompt,
            "completion_tokens": 9,
            "total_tokens": num_prompt + 9,
        }


def test_n_and_batch_index_choices_prompt_major(server):
    """Choice prompt_i * n + j is sample j of prompt i, and sample j is seeded seed + j."""
    prompts = ["state space", "token stream"]
    body = dict(max_tokens=4, temperature=1.0, ignore_eos=True)
    out = complete(server, prompt=prompts, n=2, seed=7, **body)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["completion_tokens"] == 16
    for i, prompt in enumerate(prompts):
        for j in range(2):
            alone = complete(server, prompt=prompt, seed=7 + j, **body)["choices"][0]["text"]
            assert out["choices"][i * 2 + j]["text"] == alone, (i, j)
    # Different seeds for the samples of one prompt: n draws, not one draw n times.
    many = complete(server, prompt=prompts[0], n=4, seed=11, **body)
    assert len({c["text"] for c in many["choices"]}) > 1


def test_seeded_sampling_repeats(server):
    body = dict(prompt=PROMPT, max_tokens=6, temperature=1.0, ignore_eos=True, seed=1234)
    assert complete(server, **body)["choices"] == complete(server, **body)["choices"]


def test_min_p_one_samples_the_greedy_tokens(server):
    """min_p 1 keeps only each step's most likely token: sampling at any temperature then
    gives the greedy text; min_p 0 leaves the seeded draw alone."""
    body = dict(prompt=PROMPT, max_tokens=8, ignore_eos=True, seed=7)
    greedy = complete(server, **body, temperature=0.0)["choices"][0]["text"]
    sampled = [complete(server, **body, temperature=t, min_p=1.0) for t in (1.0, 5.0)]
    assert [c["choices"][0]["text"] for c in sampled] == [greedy, greedy]
    hot = complete(server, **body, temperature=5.0)["choices"][0]["text"]
    assert complete(server, **body, temperature=5.0, min_p=0.0)["choices"][0]["text"] == hot
    assert hot != greedy  # at temperature 5 the seeded draw leaves the greedy path


def test_stop_string_cuts_the_text(server):
    body = dict(prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    full = complete(server, **body)["choices"][0]["text"]
    k = next(i for i in range(len(full) // 2, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[k : k + 2]
    out = complete(server, stop=[stop], **body)["choices"][0]
    assert out["text"] == full[: full.index(stop)]
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop


def test_stop_token_ids_end_on_the_token(server):
    body = dict(prompt=PROMPT, max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    tokens = complete(server, **body)["choices"][0]["logprobs"]["tokens"]
    # A generated token whose text tokenizes back to that one token gives its id.
    for token in tokens[1:]:
        ids = tokenize(server, token, add_special_tokens=False)
        if len(ids) == 1 and "\ufffd" not in token:
            break
    else:
        pytest.fail(f"no generated token round-trips through /tokenize: {tokens}")
    first = tokens.index(token)
    out = complete(server, stop_token_ids=ids, **body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == ids[0]
    assert out["usage"]["completion_tokens"] == first + 1  # the stop token is kept


def test_logprobs_in_completions_format(server):
    k = 3
    out = complete(
        server, prompt=PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=k
    )
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    offset = 0
    for token, logprob, top, start in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True
    ):
        assert start == offset
        offset += len(token)
        assert logprob <= 0.0
        assert token in top and top[token] == pytest.approx(logprob)
        # The k best, and the sampled token if it is not one of them; keyed by text, so
        # ids that decode alike (partial UTF-8 bytes show as U+FFFD) share a key.
        assert len(top) <= k + 1
        assert len(top) >= k or "\ufffd" in top
        assert all(v <= 0.0 for v in top.values())
        # Greedy: the sampled token is the most likely one.
        assert logprob == pytest.approx(max(top.values()))
    assert lp["text_offset"][0] == 0


def test_echo_prepends_the_prompt_and_its_logprobs(server):
    out = complete(server, prompt=PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True, echo=True)
    plain = complete(server, prompt=PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True)
    assert out["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]

    ids = tokenize(server, PROMPT)
    out = complete(
        server, prompt=ids, max_tokens=3, temperature=0.0, ignore_eos=True, echo=True, logprobs=1
    )
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    # The first prompt token has no logprob (nothing before it); every other one has.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0.0 for v in lp["token_logprobs"][1:])
    assert out["choices"][0]["text"].startswith(PROMPT)  # ids echo as their text (no BOS)
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == 3


def test_model_may_be_left_out(server):
    r = httpx.post(
        server.url_for("v1", "completions"), json={"prompt": PROMPT, "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL_NAME


def test_penalties_min_tokens_and_logit_bias_are_served_as_offline(client, tiny_model_dir):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (string token ids) and
    vLLM's repetition_penalty and min_tokens reach the engine as SamplingParams would give
    them offline: the same greedy ids; a +100 bias takes every token."""
    from vllm import LLM, SamplingParams

    prompt = [7, 12, 30, 12, 7, 99, 41]
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0.0, presence_penalty=1.5,
        frequency_penalty=0.5, logit_bias={"9": 3.0},
        extra_body={"repetition_penalty": 1.4, "min_tokens": 4, "ignore_eos": True,
                    "return_token_ids": True},
    )  # fmt: skip
    served = out.choices[0].token_ids
    llm = LLM(str(tiny_model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=10, presence_penalty=1.5, min_tokens=4,
                            frequency_penalty=0.5, logit_bias={9: 3.0}, repetition_penalty=1.4,
                            ignore_eos=True)  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want, base = (llm.generate([{"prompt_token_ids": prompt}], p, use_tqdm=False)[0]
                  for p in (params, plain))  # fmt: skip
    del llm
    assert served == want.outputs[0].token_ids
    assert served != base.outputs[0].token_ids, "the fields changed nothing: a vacuous test"
    bias = dict(prompt=prompt, max_tokens=4, temperature=0.0)
    out = client.completions.create(model=MODEL_NAME, logit_bias={"9": 100},
                                    extra_body={"return_token_ids": True}, **bias)  # fmt: skip
    assert out.choices[0].token_ids == [9, 9, 9, 9]

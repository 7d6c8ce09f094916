"""The prefix-caching workloads of `vllm bench serve` without a server: prefix repetition
sampling, ShareGPT conversations, the turn-by-turn replay (a fake send), the cached-token
metrics, the client's reading of usage.prompt_tokens_details, and the on/off table of
benchmark_prefix_caching.py."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from transformers import AutoTokenizer

from benchmarks.serving.benchmark_prefix_caching import format_markdown, table_rows
from tests.tiny_model import save_tiny_tokenizer
from vllm.benchmarks import multiturn, serve
from vllm.benchmarks.client import RequestOutput, _Stream
from vllm.benchmarks.datasets import sample_prefix_repetition
from vllm.benchmarks.metrics import cache_hits


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_prefix_repetition_groups_share_their_prefix(tokenizer):
    reqs = sample_prefix_repetition(tokenizer, 7, 12, 5, 3, 9, seed=1)
    assert len(reqs) == 6  # 7 // 3 per prefix
    assert all(r.expected_output_len == 9 for r in reqs)
    heads = [tuple(tokenizer(r.prompt, add_special_tokens=False).input_ids[:10]) for r in reqs]
    assert len(set(heads)) == 3 and all(heads.count(h) == 2 for h in set(heads))
    assert reqs == sample_prefix_repetition(tokenizer, 7, 12, 5, 3, 9, seed=1)
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        sample_prefix_repetition(tokenizer, 2, 12, 5, 3, 9)
    with pytest.raises(ValueError, match="--prefix-repetition-suffix-len"):
        sample_prefix_repetition(tokenizer, 6, 12, 0, 3, 9)


def record(*pairs, broken=False):
    turns = [
        t for q, a in pairs for t in ({"from": "human", "value": q}, {"from": "gpt", "value": a})
    ]
    if broken:
        turns.insert(2, {"from": "gpt", "value": "out of order"})
    return {"conversations": turns}


def test_sample_conversations_filters_and_cuts(tokenizer):
    records = [
        record(("q1", "a1"), ("q2", "a2")),  # too few turns
        record(("q1", "a1"), ("q2", "a2"), ("q3", "a3"), ("q4", "a4")),
        record(("q1", "a1"), ("q2", "a2"), ("q3", "a3"), broken=True),  # 1 leading pair
        record(*[("long question " * 40, "long answer " * 40)] * 3),  # over the total
        {"conversations": "not a list"},
    ]
    convs = multiturn.sample_conversations(records, tokenizer, 10, 3, 3, 300, seed=0)
    assert len(convs) == 1
    assert convs[0].user_turns == ["q1", "q2", "q3"]  # cut to 3 turns
    assert convs[0].prompt == "q1" and convs[0].prompt_len == len(tokenizer("q1").input_ids)
    fixed = multiturn.sample_conversations(records, tokenizer, 10, 3, 8, 300, output_len=5)
    assert fixed[0].output_lens == [5, 5, 5, 5]


def test_converse_sends_the_history_with_the_models_answers():
    sent = []

    async def send(messages, n):
        sent.append(messages)
        k = len(sent)
        return RequestOutput(
            success=k < 3,
            generated_text=f"answer{k}",
            output_tokens=n,
            server_prompt_tokens=10 * k,
            cached_tokens=0 if k == 1 else 7,
            ttft=0.1 * k,
            error="" if k < 3 else "HTTP 400: too long",
        )

    conv = multiturn.Conversation(["u1", "u2", "u3", "u4"], [2, 3, 4, 5], 1)
    outs = asyncio.run(multiturn.run_conversations([conv], send, float("inf"), 1.0, 0, None))
    outputs, not_sent = outs
    assert [o.turn for o in outputs] == [1, 2, 3] and not_sent == 1  # stops at the failure
    assert sent[2] == [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "answer1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "answer2"},
        {"role": "user", "content": "u3"},
    ]
    assert [o.reusable_tokens for o in outputs] == [0, 10 + 2 - 1, 20 + 3 - 1]
    m = multiturn.turn_metrics(outputs, not_sent, [99])
    assert m["num_turns"] == 3 and m["turns_not_sent"] == 1
    assert m["median_ttft_first_turn_ms"] == pytest.approx(100.0)
    assert m["median_ttft_later_turns_ms"] == pytest.approx(200.0)  # turn 3 failed
    assert m["prefix_cache_reusable_hit_rate"] == pytest.approx(7 / 11)
    assert "Hit rate of reusable tokens" in "\n".join(multiturn.format_lines(m, [99]))


def test_token_history_extends_the_prompt_by_the_generated_ids(tokenizer):
    """Turn k's ids: turn k-1's prompt, the ids it generated, the template's tokens up to
    the next generation prompt; equal to the template's rendering of the chat whenever the
    answer's text tokenizes back to those ids (here: ids taken from such a rendering)."""
    history = multiturn.TokenHistory(tokenizer)
    first = history.ask("hello there")
    chat = [{"role": "user", "content": "hello there"}]
    render = tokenizer.apply_chat_template
    assert first == multiturn._template_ids(render(chat, add_generation_prompt=True))
    answer = tokenizer.encode("fine thanks", add_special_tokens=False)
    out = RequestOutput(success=True, output_tokens=len(answer), output_token_ids=answer)
    assert history.answer(out) == ""
    second = history.ask("and you")
    chat += [
        {"role": "assistant", "content": tokenizer.decode(answer)},
        {"role": "user", "content": "and you"},
    ]
    want = multiturn._template_ids(render(chat, add_generation_prompt=True))
    assert second == want and second[: len(first) + len(answer)] == first + answer
    missing = RequestOutput(success=True, output_tokens=2)
    assert "return_token_ids" in history.answer(missing)
    short = RequestOutput(success=True, output_tokens=3, output_token_ids=[5, 6])
    assert "2 token ids for 3" in history.answer(short)


def test_a_turn_without_token_ids_ends_its_conversation(tokenizer):
    async def send(prompt, n):
        assert all(isinstance(t, int) for t in prompt)
        return RequestOutput(success=True, output_tokens=n, server_prompt_tokens=len(prompt))

    conv = multiturn.Conversation(["u1", "u2"], [2, 2], 1)
    outputs, not_sent = asyncio.run(
        multiturn.run_conversations(
            [conv], send, float("inf"), 1.0, 0, None, lambda: multiturn.TokenHistory(tokenizer)
        )
    )
    assert len(outputs) == 1 and not_sent == 1
    assert not outputs[0].success and "return_token_ids" in outputs[0].error


def test_the_stream_collects_token_ids_and_times_textless_chunks():
    out = RequestOutput()
    stream = _Stream(out, 0.0, lambda c: c.get("text") or "")
    stream.feed('{"choices": [{"text": "", "token_ids": [7], "prompt_token_ids": [1, 2]}]}', 0.1)
    stream.feed('{"choices": [{"text": "ab", "token_ids": [8, 9]}]}', 0.3)
    stream.feed("[DONE]", 0.4)
    done = stream.finish()
    assert done.success and done.output_token_ids == [7, 8, 9] and done.generated_text == "ab"
    assert done.ttft == pytest.approx(0.1) and done.itl == [pytest.approx(0.2)]


def test_cache_hits_and_the_clients_usage_reading():
    out = RequestOutput(prompt_len=3)
    stream = _Stream(out, 0.0, lambda c: c.get("text") or "")
    stream.feed('{"choices": [{"text": "x"}]}', 0.1)
    # A server without the details (null), then one with them.
    usage = {"prompt_tokens": 12, "completion_tokens": 1, "prompt_tokens_details": None}
    stream.feed(json.dumps({"choices": [], "usage": usage}), 0.2)
    assert out.server_prompt_tokens == 12 and out.cached_tokens is None
    usage["prompt_tokens_details"] = {"cached_tokens": 8}
    stream.feed(json.dumps({"choices": [], "usage": usage}), 0.3)
    stream.feed("[DONE]", 0.4)
    done = stream.finish()
    assert done.success and done.cached_tokens == 8
    plain = RequestOutput(success=True, prompt_len=4)
    assert cache_hits([plain]) == {"total_cached_tokens": None, "prefix_cache_hit_rate": None}
    assert cache_hits([done, plain]) == {"total_cached_tokens": 8, "prefix_cache_hit_rate": 8 / 12}


def test_serve_options_and_checks():
    p = serve.add_cli_args(argparse.ArgumentParser())
    args = p.parse_args(
        ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64"]
    )
    assert args.prefix_repetition_prefix_len == 64 and args.prefix_repetition_num_prefixes == 10
    serve.check_args(args)
    args = p.parse_args(["--dataset-name", "multiturn"])  # openai: the token-id history
    serve.check_args(args)
    args = p.parse_args(
        [
            "--dataset-name",
            "multiturn",
            "--backend",
            "openai-chat",
            "--multiturn-min-turns",
            "4",
            "--multiturn-max-turns",
            "3",
        ]
    )
    with pytest.raises(SystemExit, match="--multiturn-min-turns"):
        serve.check_args(args)


def test_on_off_table():
    on = {
        "median_ttft_ms": 5.0,
        "p99_ttft_ms": 8.0,
        "output_throughput": 30.0,
        "prefix_cache_hit_rate": 0.5,
    }
    off = {
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": 16.0,
        "output_throughput": 20.0,
        "prefix_cache_hit_rate": 0.0,
    }
    runs = {
        "prefix_repetition": {"on": {"result": on}, "off": {"result": off}},
        "random": {"on": {"result": on}, "off": {"result": None}},
    }
    rows = table_rows(runs)
    assert rows[0]["ok"] and rows[0]["median_ttft_ms"]["ratio"] == 0.5
    assert rows[0]["output_throughput"]["ratio"] == 1.5
    assert rows[0]["prefix_cache_hit_rate"] == {"on": 0.5, "off": 0.0, "ratio": None}
    assert "median_ttft_later_turns_ms" not in rows[0]
    assert not rows[1]["ok"]
    text = format_markdown(rows)
    assert "| TTFT median ms | 5 | 10 | 0.5 | lower |" in text
    assert "## random (a run failed)" in text


@pytest.mark.parametrize(
    "workload", ["multiturn", "multiturn_ids@2.5", "prefix_repetition", "random@inf"]
)
def test_driver_commands_parse_as_bench_serve_options(workload, tmp_path):
    from benchmarks.serving.benchmark_prefix_caching import bench_command, parse_args, server_args

    args = parse_args(["--model", "M", "--out", str(tmp_path), "--dataset-path", "s.json"])
    cmd = bench_command(args, 8001, workload, "on", tmp_path / f"{workload}.json")
    bench = serve.add_cli_args(argparse.ArgumentParser())
    parsed = bench.parse_args(cmd[cmd.index("serve") + 1 :])
    serve.check_args(parsed)
    name, _, rate = workload.partition("@")
    assert parsed.dataset_name == name.removesuffix("_ids") and parsed.port == 8001
    assert parsed.backend == ("openai-chat" if name == "multiturn" else "openai")
    assert parsed.request_rate == float(rate or args.request_rate)
    assert parsed.metadata == ["prefix_caching=on", f"workload={workload}"]
    if workload == "prefix_repetition":
        assert parsed.prefix_repetition_prefix_len == args.prefix_len
    on, off = server_args(args, "on").split(), server_args(args, "off").split()
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" not in on
    # The engine's default is on: "off" must say so.
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    flag = "--enable-mamba-prompt-end-checkpoint"
    args = parse_args(["--model", "M", "--out", str(tmp_path), f"--on-server-args={flag}"])
    assert server_args(args, "on").endswith(f"--enable-prefix-caching {flag}")
    assert flag not in server_args(args, "off")
    for bad in ("chat", "random@0", "random@x", "random,random"):
        with pytest.raises(SystemExit):
            parse_args(["--model", "M", "--out", str(tmp_path), "--workloads", bad])

"""benchmarks/serving/benchmark_prefix_caching.py end to end on the CPU: a tiny model served
with prefix caching on and off, two 3-turn ShareGPT conversations replayed through `vllm
bench serve --dataset-name multiturn` against each, and the table of the two runs.

The tiny model is made to answer every prompt with one fixed word token: its mixer's
out_proj is zeroed, so the last hidden state is the last token's embedding, which is the
same for every token, and lm_head ranks that word first. A random model's answer would not
tokenize back to the ids it generated once the chat template renders it into the history
(byte tokens, merges), and the end-of-request checkpoint would never match; a word that is
its own tokenization does, so turn 2's prompt starts with turn 1's prompt + answer, as a
real model's conversation does.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.entrypoints.utils import server_env
from tests.tiny_model import SPECIAL_TOKENS, make_tiny_model_dir
from tests.utils import run_module

pytestmark = pytest.mark.timeout(600)


def make_one_word_model(path):
    """The tiny model, answering every prompt with the same word."""
    model = make_tiny_model_dir(path, num_hidden_layers=1)
    weights = load_file(str(model / "model.safetensors"))
    for name, t in weights.items():
        if name.endswith("out_proj.weight"):
            weights[name] = torch.zeros_like(t)
    emb = torch.zeros_like(weights["backbone.embeddings.weight"])
    emb[:, 0] = 1.0
    weights["backbone.embeddings.weight"] = emb
    weights["backbone.norm_f.weight"] = torch.ones_like(weights["backbone.norm_f.weight"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    word = next(
        i
        for i in range(len(SPECIAL_TOKENS), len(tokenizer))
        if (text := tokenizer.decode([i])).isalpha()
        and tokenizer(text, add_special_tokens=False).input_ids == [i]
    )
    head = torch.zeros_like(weights["lm_head.weight"])
    head[word, 0] = 1.0
    weights["lm_head.weight"] = head
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


def sharegpt(path, conversations: int, turns: int):
    records = [
        {
            "id": str(c),
            "conversations": [
                {"from": who, "value": f"{who} {c} {t}"}
                for t in range(turns)
                for who in ("human", "gpt")
            ],
        }
        for c in range(conversations)
    ]
    path.write_text(json.dumps(records))
    return path


def run_driver(tmp_path, model, workload: str, output_len: int) -> dict:
    """benchmark_prefix_caching on one 3-turn conversation against ``model``: its summary."""
    data = sharegpt(tmp_path / "chats.json", conversations=1, turns=3)
    out = tmp_path / "out"
    server = "--max-num-seqs 1 --max-model-len 256 --mamba-block-size 4 --seed 0"
    proc = run_module(
        "benchmarks.serving.benchmark_prefix_caching",
        *("--model", model, "--out", out, "--workloads", workload),
        *("--dataset-path", data, "--num-prompts", 1, "--sharegpt-output-len", output_len),
        *("--max-concurrency", 1, "--server-args", server),
        *("--bench-args", "--ready-check-timeout-sec 0"),
        env=server_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / "prefix_caching.json").read_text())


def test_multiturn_on_off_table(tmp_path):
    out = tmp_path / "out"
    summary = run_driver(tmp_path, make_one_word_model(tmp_path / "tiny"), "multiturn", 1)
    pair = summary["runs"]["multiturn"]
    for mode in ("on", "off"):
        r = pair[mode]["result"]
        assert pair[mode]["rc"] == 0 and pair[mode]["server_rc"] == 0
        assert r["completed"] == 3 and r["failed"] == 0 and r["num_turns"] == 3
        assert r["backend"] == "openai-chat" and r["prefix_caching"] == mode
    on, off = pair["on"]["result"], pair["off"]["result"]
    assert on["total_cached_tokens"] > 0 and on["prefix_cache_hit_rate"] > 0
    # Turns 2 and 3 restore all that turn 1 and 2 ran through the model: the prompt and the
    # answer but its last token (sampled, never fed back).
    assert on["prefix_cache_reusable_hit_rate"] == 1.0
    assert off["total_cached_tokens"] == 0 and off["prefix_cache_hit_rate"] == 0
    [row] = summary["table"]
    assert row["workload"] == "multiturn" and row["ok"]
    assert row["prefix_cache_hit_rate"]["on"] > 0 and row["prefix_cache_hit_rate"]["off"] == 0
    assert row["median_ttft_ms"]["ratio"] > 0 and row["output_throughput"]["ratio"] > 0
    table = (out / "prefix_caching.md").read_text()
    assert "## multiturn" in table and "| hit rate |" in table and "TTFT turns>=2" in table


def test_multiturn_ids_reuses_whole_turns_of_a_random_model(tmp_path):
    """The token-id history (``multiturn_ids``: /v1/completions with return_token_ids) gives
    a random-weight model's conversation the prompts a chat has when answers tokenize back:
    turns 2 and 3 restore everything the turn before ran through the model."""
    model = make_tiny_model_dir(tmp_path / "tiny", num_hidden_layers=1)
    summary = run_driver(tmp_path, model, "multiturn_ids@inf", 3)
    pair = summary["runs"]["multiturn_ids@inf"]
    for mode in ("on", "off"):
        r = pair[mode]["result"]
        assert r["completed"] == 3 and r["failed"] == 0 and r["backend"] == "openai"
        assert r["total_output_tokens"] == 9
    on, off = pair["on"]["result"], pair["off"]["result"]
    # Each later prompt is the one before + its 3 generated ids + the template's tokens.
    assert on["prefix_cache_reusable_hit_rate"] == 1.0
    assert off["total_cached_tokens"] == 0
    assert on["total_input_tokens"] == off["total_input_tokens"]

"""The prefix-caching benchmark's inputs, made without a network: make_sharegpt_sample's
``--multiturn`` file (whole conversations that multiturn.py keeps) and shape_model_dir's
served directory of a named shape with another directory's tokenizer."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from benchmarks.common.shape_model_dir import main as shape_main
from benchmarks.serving.make_sharegpt_sample import main as sample_main
from tests.tiny_model import make_tiny_model_dir
from vllm.benchmarks import multiturn
from vllm.model_executor.models.registry import config_class


def test_multiturn_sample_keeps_whole_conversations_the_benchmark_reads(tmp_path):
    tok_dir = make_tiny_model_dir(tmp_path / "tiny")

    def chat(c: int, pairs: int, words: int = 3):
        turns = []
        for t in range(pairs):
            turns += [
                {"from": "human", "value": " ".join([f"q{c}{t}"] * words)},
                {"from": "gpt", "value": " ".join([f"a{c}{t}"] * words)},
            ]
        return {"id": f"c{c}", "conversations": turns}

    records = [chat(0, 2), chat(1, 3), chat(2, 10), chat(3, 4, words=400), chat(4, 5)]
    source = tmp_path / "src.json"
    source.write_text(json.dumps(records))
    out = tmp_path / "multi.json"
    with pytest.raises(SystemExit):  # no tokenizer: no length filter
        sample_main([str(out), "--source", str(source), "--multiturn", "--num", "10"])
    sample_main([str(out), "--source", str(source), "--multiturn", "--tokenizer", str(tok_dir)])
    kept = json.loads(out.read_text())
    # Two pairs are too few; 400-word turns pass 2,048 tokens; ten pairs are cut to eight.
    assert sorted(r["id"] for r in kept) == ["c1", "c2", "c4"]
    by_id = {r["id"]: r for r in kept}
    assert len(by_id["c2"]["conversations"]) == 16
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    convs = multiturn.sample_conversations(kept, tokenizer, 10)
    assert len(convs) == 3 and sorted(len(c.user_turns) for c in convs) == [3, 5, 8]


def test_shape_dir_is_the_named_shape_with_the_tokenizers_vocabulary(tmp_path):
    tok_dir = make_tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "bamba"
    shape_main([str(out), "--shape", "bamba-tiny", "--tokenizer-from", str(tok_dir)])
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["BambaForCausalLM"] and raw["model_type"] == "bamba"
    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    assert raw["vocab_size"] == vocab and "layer_types" not in raw
    config = config_class("BambaForCausalLM").from_dict(raw)
    assert config.vocab_size == vocab and config.num_hidden_layers == raw["num_hidden_layers"]
    assert len(AutoTokenizer.from_pretrained(out)) == vocab

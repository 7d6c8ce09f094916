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


@pytest.mark.parametrize("shape", ["nemotron-3-nano-cpu", "granite-4.0-h-cpu"])
def test_shape_dir_keeps_the_layer_kinds(tmp_path, shape):
    # Before 2026-12-06 every shape's layer_types was dropped: the MoE hybrids' directories
    # loaded as all-Mamba models (Granite's default) or not at all (NemotronH).
    from benchmarks.common.model_shapes import named_config
    from vllm.model_executor.models.registry import load_model_config

    tok_dir = make_tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / shape
    shape_main([str(out), "--shape", shape, "--tokenizer-from", str(tok_dir)])
    want = named_config(shape).layer_types
    assert len(set(want)) > 1 and "mamba" in want  # a hybrid: the check below can fail
    assert load_model_config(str(out)).layer_types == want


def test_shape_dir_refuses_a_directory_that_loads_as_another_model(tmp_path, monkeypatch):
    from benchmarks.common import hf_models, shape_model_dir

    tok_dir = make_tiny_model_dir(tmp_path / "tiny")
    monkeypatch.setattr(hf_models, "_RENAMES", {})  # NemotronH's kinds under our own name
    with pytest.raises(ValueError, match="names no layers"):
        shape_main([str(tmp_path / "n"), "--shape", "nemotron-3-nano-cpu",
                    "--tokenizer-from", str(tok_dir)])  # fmt: skip
    # Granite without its kinds loads, as an all-Mamba model: the check refuses it.
    real = shape_model_dir.hf_config_kwargs
    drop = lambda c: {k: v for k, v in real(c).items() if k != "layer_types"}  # noqa: E731
    monkeypatch.setattr(shape_model_dir, "hf_config_kwargs", drop)
    with pytest.raises(ValueError, match="layer_types: .* read back as"):
        shape_main([str(tmp_path / "g"), "--shape", "granite-4.0-h-cpu",
                    "--tokenizer-from", str(tok_dir)])  # fmt: skip

"""benchmarks/common/make_model_dir.py: Mistral's v3 SentencePiece tokenizer converted to a fast HF
tokenizer (equal to SentencePiece's encoding), a config.json the loader reads as the
Codestral-7B (or tiny) shape, and the directory served by a live `vllm serve
--load-format dummy` that `vllm bench serve` measures with exact random prompt lengths."""

from __future__ import annotations

import importlib.util
import json

import pytest

if importlib.util.find_spec("mistral_common") is None:
    pytest.skip(
        "mistral-common (requirements/bench.txt) is not installed: it ships the tokenizer "
        "file; the GPU box has none and no network",
        allow_module_level=True,
    )

from benchmarks.common.make_model_dir import (
    CHECK_TEXTS,
    TINY_SHAPE,
    make_model_dir,
    v3_tokenizer_path,
)
from tests.entrypoints.utils import RemoteServer

ENGLISH = (
    "State space models process a sequence one token at a time while keeping a fixed-size "
    "state, so the cost of each new token does not grow with the length of the context. "
    "This makes them attractive for serving long conversations on a single accelerator."
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral_tiny")
    check = make_model_dir(path, tiny=True, check_texts=[ENGLISH])
    assert check == {"texts": len(CHECK_TEXTS) + 1, "differ_by_control_strings": 1}
    return path


def test_directory_is_self_contained(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    # No tokenizer.model: loading needs neither sentencepiece nor mistral-common.
    assert names == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }


def test_configs_resolve_for_dummy_serving(tiny_dir, tmp_path):
    from vllm.config import EngineConfig
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    tiny = EngineConfig(model=str(tiny_dir), load_format="dummy")
    assert tiny.model_config == Mamba2ModelConfig(**TINY_SHAPE, dtype="float32")
    big_dir = tmp_path / "codestral"
    make_model_dir(big_dir)
    big = EngineConfig(model=str(big_dir), load_format="dummy")
    assert big.model_config == Mamba2ModelConfig(dtype="bfloat16")  # Codestral-7B's shape
    raw = json.loads((big_dir / "config.json").read_text())
    assert raw["model_type"] == "mamba2" and raw["architectures"] == ["Mamba2ForCausalLM"]
    assert raw["time_step_limit"] == [0.0, float("inf")]  # written as Infinity
    assert (raw["bos_token_id"], raw["eos_token_id"]) == (1, 2)


def test_engine_tokenizer_matches_sentencepiece(tiny_dir):
    import sentencepiece

    from vllm.engine.tokenizer import HFTokenizer, get_tokenizer

    tok = get_tokenizer(tiny_dir, 32768)
    assert isinstance(tok, HFTokenizer) and tok._tok.is_fast
    assert (tok.eos_token_id, tok.vocab_size) == (2, 32768)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(v3_tokenizer_path()))
    texts = [*CHECK_TEXTS[:-1], ENGLISH, "  x  ", "(A+B)².", "a\n\n\tb", "日本語のテキスト"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.encode(text) == [1, *ids]  # BOS in front, as Mistral's tokenizers add it
        assert tok.decode(ids) == sp.decode(ids)
    words = len(ENGLISH.split())
    assert words < len(tok.encode(ENGLISH)) < 2 * words  # realistic counts for English


def test_chat_template_uses_the_control_tokens(tiny_dir):
    from vllm.engine.tokenizer import get_tokenizer

    tok = get_tokenizer(tiny_dir, 32768)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<s>[INST] Be brief.\n\nHi [/INST]"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [1, 3] and ids[-1] == 4  # <s> [INST] ... [/INST]


def test_served_with_dummy_weights_and_benchmarked(tiny_dir, tmp_path):
    from vllm.benchmarks.serve import cli

    args = ["--load-format", "dummy", "--max-num-seqs", "4", "--max-model-len", "256"]
    with RemoteServer(tiny_dir, args) as server:
        record = cli(
            [
                "--base-url",
                server.base_url,
                "--dataset-name",
                "random",
                "--random-input-len",
                "24",
                "--random-output-len",
                "3",
                "--num-prompts",
                "3",
                "--ignore-eos",
                "--save-detailed",
                "--disable-tqdm",
            ]
        )
    assert record["model_id"] == str(tiny_dir)  # taken from /v1/models
    assert (record["completed"], record["failed"]) == (3, 0)
    # This tokenizer re-encodes the decoded random prompts exactly: 24 + BOS each.
    assert record["input_lens"] == [25] * 3 and record["total_output_tokens"] == 9

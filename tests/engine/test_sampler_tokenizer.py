"""Sampler filters and seeding; tokenizers and incremental detokenization."""

from __future__ import annotations

import pytest
import torch

from vllm.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, get_tokenizer
from vllm.sampling_params import SamplingParams
from vllm.step_io import SamplingMetadata
from vllm.worker.sampler import Sampler


def rows_of(*params: SamplingParams) -> SamplingMetadata:
    """The sampling metadata of one row per ``params``, request ids "0", "1", ..."""
    return SamplingMetadata(
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        seeds=[p.seed for p in params],
        request_ids=[str(i) for i in range(len(params))],
        logprobs=[p.logprobs for p in params],
    )


def test_greedy_top_k_top_p_keep_to_their_support():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 0.5]]).repeat(4, 1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0, top_k=2),
        # softmax at T=1: tokens 1 and 3 hold ~0.82 of the mass, token 2 brings it to ~0.92
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, top_p=0.9),
    ]
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = [set() for _ in params]
    for _ in range(300):
        for i, tok in enumerate(sampler.sample(logits, rows_of(*params)).tolist()):
            seen[i].add(tok)
    assert seen[0] == {1}
    assert seen[1] == {1, 3}
    assert seen[2] == {1, 3}
    assert seen[3] == {1, 3, 2}


def test_min_p_keeps_the_tokens_near_the_top():
    """min_p p keeps the tokens at least p times as likely as the row's most likely one,
    after temperature: the support shrinks as p grows and widens with the temperature."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 0.5]]).repeat(4, 1)
    # softmax at T=1 relative to token 1: token 3 e^-1 ~0.37, token 2 e^-2 ~0.14, ...
    params = [
        SamplingParams(temperature=1.0, min_p=0.3),  # tokens 1 and 3
        SamplingParams(temperature=1.0, min_p=0.1),  # and token 2
        # T=10: token 3 e^-0.1 ~0.90, token 2 e^-0.2 ~0.82, token 5 e^-0.25 ~0.78
        SamplingParams(temperature=10.0, min_p=0.8),
        SamplingParams(temperature=1.0, min_p=1.0),  # only the top
    ]
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = [set() for _ in params]
    for _ in range(300):
        for i, tok in enumerate(sampler.sample(logits, rows_of(*params)).tolist()):
            seen[i].add(tok)
    assert seen == [{1, 3}, {1, 2, 3}, {1, 2, 3}, {1}]


def test_min_p_is_checked_by_name():
    for bad in (-0.1, 1.5, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="min_p"):
            SamplingParams(min_p=bad)
    assert SamplingParams(n=2, min_p=0.25).child(1).min_p == 0.25


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    batch = rows_of(SamplingParams(), SamplingParams(temperature=1.0, seed=42), SamplingParams())
    alone = [
        Sampler(torch.device("cpu"), 1).sample(logits[1:2], batch.row(1)).tolist()[0]
        for _ in range(2)
    ]
    s = Sampler(torch.device("cpu"), 7)
    draws = [s.sample(logits, batch).tolist()[1] for _ in range(5)]
    assert draws[0] == alone[0] == alone[1]
    assert len(set(draws)) > 1  # the row's generator moves on from draw to draw ...
    s.forget(["1"])  # ... until its request is forgotten: then it starts from the seed again
    assert [s.sample(logits, batch).tolist()[1] for _ in range(5)] == draws


def test_byte_fallback_and_incremental_detokenization():
    tok = get_tokenizer(None, vocab_size=300)
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_id is None
    text = "naïve → 東京!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    prompt = tok.encode("ab")
    detok = IncrementalDetokenizer(tok, prompt)
    tokens, pieces = list(prompt), []
    for t in ids:
        tokens.append(t)
        pieces.append(detok.step(tokens))
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[ids.index(0xC3)] == ""  # first byte of "ï": held back until complete


def test_hf_tokenizer_from_the_model_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "hello": 1, "world": 2, "again": 3, "[UNK]": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>").save_pretrained(tmp_path)
    tok = get_tokenizer(tmp_path, vocab_size=5)
    assert tok.eos_token_id == 0
    assert tok.encode("hello world") == [1, 2]
    detok = IncrementalDetokenizer(tok, [1])
    assert detok.step([1, 2]).strip() == "world"
    assert detok.step([1, 2, 3]).strip() == "again"

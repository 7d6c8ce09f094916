"""Sampler filters and seeding; tokenizers and incremental detokenization."""

from __future__ import annotations

import torch

from vllm.engine.sampler import Sampler
from vllm.engine.sequence import Sequence
from vllm.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, get_tokenizer
from vllm.sampling_params import SamplingParams


def seqs_with(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(str(i), [1], p) for i, p in enumerate(params)]


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
        for i, tok in enumerate(sampler.sample(logits, seqs_with(*params)).tolist()):
            seen[i].add(tok)
    assert seen[0] == {1}
    assert seen[1] == {1, 3}
    assert seen[2] == {1, 3}
    assert seen[3] == {1, 3, 2}


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [
        Sampler(torch.device("cpu"), 1).sample(logits[1:2], seqs_with(p)).tolist()[0]
        for _ in range(2)
    ]
    s = Sampler(torch.device("cpu"), 7)
    batch = seqs_with(SamplingParams(), SamplingParams(temperature=1.0, seed=42), SamplingParams())
    got = s.sample(logits, batch).tolist()[1]
    assert got == alone[0] == alone[1]


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

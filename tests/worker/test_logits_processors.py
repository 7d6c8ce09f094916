"""Logits processing ahead of sampling (vllm/worker/logits_processors.py): the three
penalties against a reference written here from their definitions, the counts kept on the
device across steps (bumped by the sampler's own draws), min_tokens' bans, logit_bias, the
model's logits left as they were (logprobs are of those), rows without a request for it
untouched, the pool growing and its rows freed and restarted."""

from __future__ import annotations

import pytest
import torch

from vllm.step_io import SamplingMetadata
from vllm.worker.logits_processors import TokenCounts, process
from vllm.worker.sampler import Sampler

VOCAB = 32
CPU = torch.device("cpu")


def _md(n: int, **rows) -> SamplingMetadata:
    """Greedy metadata of ``n`` rows (ids r0..), with the per-row lists given."""
    base = dict(temperature=[0.0] * n, top_k=[-1] * n, top_p=[1.0] * n, min_p=[0.0] * n,
                seeds=[None] * n, logprobs=[None] * n)  # fmt: skip
    base["request_ids"] = [f"r{i}" for i in range(n)]
    return SamplingMetadata(**{**base, **rows})


def _reference(logits, prompt, output, pres, freq, rep):
    """vLLM's definition: repetition over prompt and output tokens (positive logits
    divided, the others multiplied), then frequency times the output count, then presence
    for each token in the output."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def test_penalties_equal_their_definition_over_steps():
    g = torch.Generator().manual_seed(0)
    counts = TokenCounts(CPU)
    prompts = [[1, 2, 2, 7], [3, 4], [5]]
    pres, freq, rep = [0.5, 0.0, -1.5], [0.25, 1.5, 0.0], [1.3, 1.0, 0.7]
    outputs: list[list[int]] = [[], [], []]
    for step in range(4):
        logits = torch.randn(4, VOCAB, generator=g) * 3  # row 3 asks for nothing
        inits = [
            (p if r != 1.0 else []) if step == 0 else None
            for p, r in zip(prompts, rep, strict=True)
        ]
        md = _md(4, presence_penalty=pres + [0.0], frequency_penalty=freq + [0.0],
                 repetition_penalty=rep + [1.0], penalty_init=inits + [None])  # fmt: skip
        raw = logits.clone()
        got, (rows, idx) = process(logits, md, counts)
        assert torch.equal(logits, raw), "the model's logits are left as they were"
        assert idx.tolist() == [0, 1, 2]
        for i in range(3):
            want = _reference(raw[i], prompts[i] if rep[i] != 1.0 else [], outputs[i],
                              pres[i], freq[i], rep[i])  # fmt: skip
            torch.testing.assert_close(got[i], want)
        torch.testing.assert_close(got[3], raw[3])
        # Tokens that repeat, so that counts above 1 are exercised.
        drawn = torch.tensor([7, 4, 5 + step % 2])
        counts.record(rows, drawn)
        for i in range(3):
            outputs[i].append(int(drawn[i]))


def test_greedy_rows_see_their_own_draws_through_the_sampler():
    """The sampler counts each penalised row's token itself: a flat row with one favourite
    token takes it once, then the presence penalty sends it to the next one."""
    sampler = Sampler(CPU, seed=0)
    logits = torch.zeros(2, VOCAB)
    logits[:, 3], logits[:, 4] = 1.0, 0.9
    md0 = _md(2, presence_penalty=[2.0, 0.0], penalty_init=[[], None])
    assert sampler.sample(logits, md0).tolist() == [3, 3]
    md1 = _md(2, presence_penalty=[2.0, 0.0], penalty_init=[None, None])
    assert sampler.sample(logits, md1).tolist() == [4, 3]
    assert sampler.sample(logits, md1).tolist() == [0, 3]  # 3 and 4 below the zeros now
    sampler.forget(["r0"])
    assert not sampler.token_counts.rows and len(sampler.token_counts.free) == 8
    with pytest.raises(RuntimeError, match="request r0: a penalty without token counts"):
        sampler.sample(logits, md1)


def test_min_tokens_bans_and_logit_bias():
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 5.0  # the "EOS" every row would take
    md = _md(3, banned=[[0, 9], [], [0]], logit_bias=[None, {7: 100.0, 0: -100.0}, {2: 6.0}])
    got, penalised = process(logits, md, TokenCounts(CPU))
    assert penalised is None
    assert got[0, 0] == got[0, 9] == float("-inf") and got[0, 1] == 0.0
    assert (got[1, 7], got[1, 0]) == (100.0, -95.0)
    assert got[2, 0] == float("-inf") and got[2, 2] == 6.0
    assert Sampler(CPU, 0).sample(logits, md).tolist() == [1, 7, 2]


def test_rows_built_without_the_columns_are_left_alone():
    """Metadata a tool builds with the first fields only: nothing to process, the same
    object back."""
    logits = torch.randn(2, VOCAB)
    got, penalised = process(logits, _md(2), TokenCounts(CPU))
    assert got is logits and penalised is None


def test_the_pool_grows_keeps_its_counts_and_reuses_freed_rows():
    counts = TokenCounts(CPU)
    first = _md(1, request_ids=["a"], frequency_penalty=[1.0], penalty_init=[[]])
    rows, _ = process(torch.zeros(1, VOCAB), first, counts)[1]
    counts.record(rows, torch.tensor([5]))
    many = _md(20, request_ids=[f"x{i}" for i in range(20)], frequency_penalty=[1.0] * 20,
               penalty_init=[[]] * 20)  # fmt: skip
    process(torch.zeros(20, VOCAB), many, counts)
    assert counts.counts.shape[0] == 32  # 8 -> 16 -> 32
    again = _md(1, request_ids=["a"], frequency_penalty=[1.0], penalty_init=[None])
    got, _ = process(torch.zeros(1, VOCAB), again, counts)
    assert got[0, 5] == -1.0 and got[0].sum() == -1.0, "a's count survived the growth"
    row = counts.rows["a"]
    counts.forget(["a"])
    restart = _md(1, request_ids=["b"], frequency_penalty=[1.0], penalty_init=[[]])
    got, (rows, _) = process(torch.zeros(1, VOCAB), restart, counts)
    assert rows.tolist() == [row] and got[0].sum() == 0.0, "a reused row starts from zero"

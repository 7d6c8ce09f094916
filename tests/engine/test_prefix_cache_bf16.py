"""Prefix caching with a bf16 SSM state (``mamba_ssm_cache_dtype="bfloat16"``, fp32 weights
and activations), pure Mamba2 and the Bamba hybrid.

A checkpoint is a copy of the state's bits, so when caching on makes the same computations
as caching off, the outputs are equal bit for bit: a prefix restored at a chunk end that
caching off also ends a chunk on (the budget cuts both at 8), and a conversation whose every
token is a one-token row (``long_prefill_token_threshold=1``: a prompt's tokens after its
first are computed as decodes are). Where the restored prefix was computed otherwise than
caching off computes the same tokens (the first turn's outputs were decoded one at a time
and its state stored in bf16 after each; caching off prefills them in chunks), the state
went through other bf16 roundings (and align cut the first turn's first chunk at 4 where
caching off cuts it at 6), and the logprobs agree within ``BF16_LOGPROB_ATOL``
(seen at most 2.1e-4 on the CPU interpreter; fp32 states agree within 1e-5) while the
greedy tokens are equal. Every test asserts the tokens it restores."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.utils import BAMBA, STREAMS_CONFIG, prefix_llm, run_greedy
from tests.models.hybrid_utils import record_figure

pytestmark = pytest.mark.timeout(900)
MODELS = {"mamba2": STREAMS_CONFIG, "bamba": BAMBA}
BF16_LOGPROB_ATOL = 2e-3  # ten times the largest difference seen (2.1e-4, Bamba)
FIRST = [5, 17, 3, 3, 40, 9, 71]
OTHER = [90, 2, 2, 61, 33, 7]  # an unrelated prompt: it overwrites a freed slot
SYSTEM = [random.Random(7).randrange(96) for _ in range(10)]  # shared by r1, r2, r3


def make_llm(device, model: str, cache: bool, **kw):
    """fp32 weights, a bf16 SSM state, chunked prompts; ``kw`` overrides."""
    options = dict(mamba_ssm_cache_dtype="bfloat16", max_model_len=48)
    llm = prefix_llm(device, cache, model=MODELS[model], **{**options, **kw})
    assert llm.llm_engine.runner.pool.ssm_state.dtype == torch.bfloat16
    return llm


def two_turns(llm, n1: int = 5, n2: int = 4, cached: int = 0):
    """The first turn, an unrelated request, then the second turn (the first turn's
    prompt, its answer and three tokens), which must restore ``cached`` tokens."""
    out1 = run_greedy(llm, FIRST, n1)
    run_greedy(llm, OTHER, 2)
    out2 = run_greedy(llm, FIRST + out1[0] + [12, 60, 2], n2)
    assert out2[2] == cached
    return out1, out2


@pytest.mark.parametrize("model", MODELS)
def test_a_shared_prefix_restored_at_a_common_chunk_end_is_bit_exact(device, model):
    """A 10-token system prompt and three questions under a budget of 8: every prompt's
    first chunk ends at 8 with caching on and off. r1 writes its align checkpoint there,
    r2 and r3 restore it and compute the same rest as caching off: equal bit for bit. (r1 is
    a cold prompt: its align checkpoint needs the cold flag.)"""
    prompts = [SYSTEM + q for q in ([3, 1, 4], [1, 5, 9], [2, 6, 5])]
    outs = {}
    for cache in (True, False):
        llm = make_llm(device, model, cache, max_num_batched_tokens=8,
                       enable_mamba_align_cold_checkpoint=True)  # fmt: skip
        got = [run_greedy(llm, prompts[0], 3), run_greedy(llm, prompts[1], 3)]
        run_greedy(llm, OTHER, 2)  # overwrites the freed slot
        got.append(run_greedy(llm, prompts[2], 3))
        outs[cache] = got
        if cache:
            assert [o[2] for o in got] == [0, 8, 8]
            assert llm.llm_engine.engine_core.prefix.index.hits == 16
    for on, off in zip(outs[True], outs[False], strict=True):
        assert on[0] == off[0] and on[1] == off[1]  # tokens and logprobs, exactly


def test_one_token_rows_restore_bit_exact(device):
    """``long_prefill_token_threshold=1``: every token after a prompt's first is a
    one-token row, with caching on and off alike, so the second turn's restored state went
    through the same computations and roundings as caching off's: equal bit for bit."""
    outs = {}
    for cache in (True, False):
        llm = make_llm(device, "mamba2", cache, long_prefill_token_threshold=1)
        outs[cache] = two_turns(llm, cached=len(FIRST) + 4 if cache else 0)
        if cache:
            assert llm.llm_engine.engine_core.prefix.index.hits == len(FIRST) + 4
    for on, off in zip(outs[True], outs[False], strict=True):
        assert on[0] == off[0] and on[1] == off[1]


@pytest.mark.parametrize("model", MODELS)
def test_next_turn_equals_caching_off_within_bf16_rounding(device, model):
    """The multi-turn test of test_prefix_cache_engine.py (budget 6, chunks cut on and off
    the grid) with a bf16 state: the second turn restores 11 tokens, its greedy tokens
    equal caching off's and its logprobs differ by bf16 roundings only."""
    on = make_llm(device, model, True, max_num_batched_tokens=6)
    got = two_turns(on, cached=len(FIRST) + 4)
    assert on.llm_engine.engine_core.prefix.index.hits == len(FIRST) + 4
    ref = two_turns(make_llm(device, model, False, max_num_batched_tokens=6))
    for out, want in zip(got, ref, strict=True):
        assert out[0] == want[0]
        diff = max(abs(a - b) for a, b in zip(out[1], want[1], strict=True))
        record_figure(f"{model} bf16 state, prefix caching: max |logprob on - off| = {diff:.2e}")
        assert diff <= BF16_LOGPROB_ATOL

"""Admission under prefix caching counts the hit (pure Mamba2 and the Bamba hybrid): a request
whose prompt restores a cached prefix is scheduled as only its rest. Its first step
computes ``len(prompt) - num_cached_tokens`` prompt tokens (the step's ``StepStats`` and the
``StepInputs`` the executor gets: the row's length, context, ids and positions), so a
prompt longer than the step's remaining token budget whose rest fits is prefilled in that
one step and samples its first token there, where caching off cuts it to the budget. The
KV side of a hybrid's admission is conservative (docs/prefix_caching.md, "Reservations"):
the worst case is reserved as if nothing were shared, so a request that would fit only
thanks to a shared block waits. Every test asserts its hits and compares greedy tokens and
logprobs with caching off. What is tested is the scheduling, so the kernels run as their
PyTorch references (TRITON_INTERPRET=0); the kernels under caching are tested in
test_prefix_cache_engine.py, test_prefix_cache_prompt.py and test_prefix_cache_hybrid.py."""

from __future__ import annotations

import pytest
import torch

from tests.engine.utils import (
    BAMBA,
    STREAMS_CONFIG,
    greedy_logprobs,
    prefix_llm,
    recording,
    run_greedy,
)

pytestmark = pytest.mark.timeout(600)
BUDGET = 8  # max_num_batched_tokens
FIRST = [5, 17, 3, 3, 40, 9, 71]
OTHER = [90, 2, 2, 61, 33, 7]  # an unrelated prompt: it decodes beside the second turn
MODELS = {"mamba2": STREAMS_CONFIG, "bamba": BAMBA}


@pytest.fixture(autouse=True)
def _references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def make_llm(model: str, cache: bool, **kw):
    options = dict(max_num_batched_tokens=BUDGET, max_model_len=48, block_size=8)
    return prefix_llm(torch.device("cpu"), cache, model=MODELS[model], **{**options, **kw})


class Driver:
    """Requests added and steps run one at a time; each step's ``StepStats``, the
    tokens each request got in it and every finished request's (tokens, logprobs)."""

    def __init__(self, llm):
        self.engine = llm.llm_engine
        self.core = self.engine.engine_core
        self.inputs = recording(llm)
        self.done: dict[str, tuple[list[int], list[float]]] = {}
        self.cached: dict[str, int] = {}

    def add(self, rid: str, prompt: list[int], n: int) -> None:
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, greedy_logprobs(n))

    def step(self):
        """One step: (its StepStats, {request id: its tokens so far})."""
        got = {}
        for o in self.engine.step():
            out = o.outputs[0]
            got[o.request_id] = list(out.token_ids)
            if o.num_cached_tokens is not None:
                self.cached[o.request_id] = o.num_cached_tokens
            if o.finished:
                lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
                self.done[o.request_id] = (list(out.token_ids), lps)
        return self.core.last_step, got

    def finish(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()


def same(got, ref) -> None:
    assert got[0] == ref[0]
    assert got[1] == pytest.approx(ref[1], rel=1e-4, abs=1e-5)


def second_turn_beside_a_decode(llm):
    """The first turn, then an unrelated request (it takes the first turn's freed slot and
    overwrites its state) until it decodes, then the second turn (15 tokens) beside it.
    Returns (driver, first turn, second prompt, the second turn's admission step's
    StepStats, its StepInputs, the tokens each request got in it)."""
    out1 = run_greedy(llm, FIRST, 5)
    second = FIRST + out1[0] + [12, 60, 2]
    d = Driver(llm)
    d.add("other", OTHER, 8)
    d.step()  # its whole prompt (6 tokens) and its first token
    d.add("turn2", second, 3)
    stats, got = d.step()
    return d, out1, second, stats, d.inputs[-1], got


@pytest.mark.parametrize("model", MODELS)
def test_a_restored_prompt_is_scheduled_as_only_its_rest(model):
    """After the other request's decode (one token) the step has 7 tokens of budget left;
    the second turn's prompt is 15 tokens, of which 11 (the first turn's prompt and all
    but its last output) are restored: its first step computes exactly the 4 others,
    samples its first token, and the next step decodes it. Caching off, the same step cuts
    the whole prompt to the 7 tokens left and samples nothing for it."""
    on = make_llm(model, True)
    d, out1, second, stats, inputs, got = second_turn_beside_a_decode(on)
    cached = len(FIRST) + len(out1[0]) - 1
    rest = len(second) - cached
    assert (cached, rest) == (11, 4) and len(second) > BUDGET - 1 >= rest
    assert stats.prefix_cache_hits == cached and stats.prefix_cache_queries == len(second)
    assert d.core.prefix.index.hits == cached, "the second turn did not hit the cache"
    assert stats.num_prefill_tokens == rest and stats.num_decode_tokens == 1
    # Rows: the other request's decode, then the second turn's rest after its 11 tokens.
    assert inputs.lens == [1, rest] and inputs.contexts == [len(OTHER), cached]
    assert inputs.ids[1:] == second[cached:]
    # attention positions (the pure Mamba model has none)
    assert inputs.positions[1:] == (list(range(cached, len(second))) if model == "bamba" else [])
    assert d.core.requests["turn2"].num_computed_tokens == len(second)
    assert len(got["turn2"]) == 1 and d.cached["turn2"] == cached
    stats, got = d.step()  # now a decode beside the other one
    assert stats.num_prefill_tokens == 0 and stats.num_decode_tokens == 2
    assert len(got["turn2"]) == 2
    d.finish()

    off = make_llm(model, False)
    r, ref1, _, stats, inputs, got = second_turn_beside_a_decode(off)
    assert stats.num_prefill_tokens == BUDGET - 1 and inputs.lens == [1, BUDGET - 1]
    assert inputs.contexts == [len(OTHER), 0] and "turn2" not in got
    assert r.core.requests["turn2"].num_computed_tokens == BUDGET - 1
    r.finish()
    same(out1, ref1)
    for rid in ("other", "turn2"):
        same(d.done[rid], r.done[rid])


@pytest.mark.parametrize("model", MODELS)
def test_a_restore_to_the_last_prompt_token_is_a_one_token_row(model):
    """A prompt whose every token but the last is restored: its first step computes one
    prompt token, a one-token row at the front of the batch (the canonical order), beside
    the other request's decode."""
    on = make_llm(model, True)
    out1 = run_greedy(on, FIRST, 5)
    second = FIRST + out1[0]  # the checkpoint covers all but out1[-1]
    d = Driver(on)
    d.add("other", OTHER, 4)
    d.step()
    d.add("turn2", second, 3)
    stats, got = d.step()
    assert stats.prefix_cache_hits == len(second) - 1 == d.core.prefix.index.hits
    assert stats.num_prefill_tokens == 1 and stats.num_decode_tokens == 1
    inputs = d.inputs[-1]
    assert inputs.lens == [1, 1] and inputs.num_decodes == 2
    assert inputs.contexts[1] == len(second) - 1 and inputs.ids[1] == second[-1]
    assert len(got["turn2"]) == 1
    d.finish()

    off = make_llm(model, False)
    run_greedy(off, FIRST, 5)
    r = Driver(off)
    r.add("other", OTHER, 4)
    r.step()
    r.add("turn2", second, 3)
    r.finish()
    for rid in ("other", "turn2"):
        same(d.done[rid], r.done[rid])


def test_kv_admission_reserves_as_if_nothing_were_shared():
    """Bamba, five KV blocks of 8 tokens. y1 and y2 both restore the first turn's 11
    tokens (its full first block shared, its tail copied) and each may grow to 24 tokens,
    three blocks. While y1 runs (holding the shared block), two blocks are available to
    others: y2 needs only two beyond the shared one, but admission reserves its worst case
    as if nothing were shared (three), so it waits until y1 finishes; then it restores the
    same 11 tokens and both equal caching off."""
    on = make_llm("bamba", True, num_gpu_blocks_override=5, max_model_len=40)
    kv = on.llm_engine.engine_core.scheduler.kv
    out1 = run_greedy(on, FIRST, 5)
    y1, y2 = FIRST + out1[0] + [12, 60, 2], FIRST + out1[0] + [50, 51, 52]
    d = Driver(on)
    d.add("y1", y1, 9)
    d.step()
    shared = kv.block_table("y1")[0]
    d.add("y2", y2, 9)
    waited = 0
    while "y1" not in d.done:
        d.step()
        if "y1" not in d.done:
            assert [s.request_id for s in d.core.scheduler.waiting] == ["y2"]
            assert kv.refs_of(shared) == 1 and kv.num_available_blocks == 2
            assert not kv.can_reserve("y2", len(y2) + 9)  # 3 blocks, 1 of them shared
            waited += 1
    assert waited == 7  # the steps of y1's decodes but its last
    d.finish()
    assert d.cached == {"y1": 11, "y2": 11} and d.core.prefix.index.hits == 22
    kv.check()

    off = make_llm("bamba", False, num_gpu_blocks_override=5, max_model_len=40)
    run_greedy(off, FIRST, 5)
    r = Driver(off)
    r.add("y1", y1, 9)
    r.add("y2", y2, 9)
    r.finish()
    for rid in ("y1", "y2"):
        same(d.done[rid], r.done[rid])

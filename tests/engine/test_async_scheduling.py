"""Async scheduling (a step dispatched before the previous step's tokens are read) gives
the same outputs as reading every step's tokens at once, whatever ends the requests."""

from __future__ import annotations

import pytest

from tests.engine.utils import ASYNC_SCHED_CONFIG as CONFIG
from tests.engine.utils import generate_outcomes as run
from tests.engine.utils import workload
from vllm import LLM, SamplingParams
from vllm.engine.sequence import PENDING_TOKEN

pytestmark = pytest.mark.timeout(600)


def make_llm(device, async_scheduling: bool) -> LLM:
    return LLM(
        CONFIG,
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        async_scheduling=async_scheduling,
    )


def test_async_equals_sync(device, monkeypatch):
    """Async scheduling gives the sync run's tokens, text and finish reasons, also when an
    end-of-sequence token or a stop string ends requests mid-way. What is tested is the
    pipelining, so on the CPU the kernels run as their PyTorch references
    (TRITON_INTERPRET=0; the kernels' own equality is tested in tests/kernels)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    prompts, params = workload(3)
    sync, asyn = make_llm(device, False), make_llm(device, True)
    base = run(sync, prompts, params)
    assert all(PENDING_TOKEN not in toks for toks, _, _ in base)
    # An end-of-sequence token and a stop string that the plain run meets mid-way.
    longest = max(base, key=lambda r: len(r[0]))
    eos = longest[0][len(longest[0]) // 2]
    text = next(r[1] for r in base if len(r[1]) >= 4)
    for kwargs in ({}, {"eos": eos}, {"stops": [text[1:3]]}):
        want = run(sync, prompts, params, **kwargs) if kwargs else base  # base: the same run
        got = run(asyn, prompts, params, **kwargs)
        assert got == want, kwargs
        if kwargs:
            assert any(reason == "stop" for _, _, reason in want), "nothing stopped early"
    assert asyn.engine.scheduler.slots.num_used == 0 and not asyn.engine.has_unfinished_requests()


def test_one_step_in_flight_at_most(device):
    llm = make_llm(device, True)
    engine = llm.engine
    for i, p in enumerate(([1, 2, 3], [4] * 20)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=5))
    done = []
    while engine.has_unfinished_requests():
        done += [out for out in engine.step() if out.finished]
        for seq in engine.scheduler.running:
            assert seq.token_ids.count(PENDING_TOKEN) <= 1  # the step in flight only
            assert seq.num_output_tokens <= 5
    assert sorted(len(o.outputs[0].token_ids) for o in done) == [5, 5]
    assert engine.engine_core._in_flight is None

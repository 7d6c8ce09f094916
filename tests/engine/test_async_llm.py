"""AsyncLLM: many concurrent streams over one engine loop, each with exactly its own
outputs; leaving a stream early aborts it and frees its slot; a failing request fails
alone; a bad request is refused before anything is queued; with the core on the loop's
thread, the loop's stats cover its wall time. Each with the engine core on the loop's
thread (``engine_process=False``) and, where it applies, in its own process
(test_core_proc.py has that mode's own cases)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.engine.utils import DELTA, Records, collect, delta
from tests.engine.utils import STREAMS_CONFIG as CONFIG
from tests.engine.utils import STREAMS_OPTS as OPTS
from tests.engine.utils import run_coro as run
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from vllm.engine.core import EngineCoreRequest
from vllm.engine.core_client import InprocClient
from vllm.worker.sampler import Sampler

pytestmark = pytest.mark.timeout(600)
MODES = pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])


@pytest.fixture(scope="module")
def offline():
    return LLM(CONFIG, **OPTS)


def prompts(n: int) -> list[list[int]]:
    return [[(5 * i + j) % 128 for j in range(1 + i % 7)] for i in range(n)]


def slots_all_free(engine: AsyncLLM) -> bool:
    """No slot taken: the scheduler's count on the loop's thread; with the core in its own
    process, what its last step reported (and no request left on this side)."""
    if engine.engine_process:
        return engine.num_requests_running == 0 and not engine.core.has_unfinished_requests()
    return engine.core.engine_core.scheduler.slots.num_used == 0


@MODES
def test_concurrent_streams_get_exactly_their_tokens(offline, engine_process):
    ps = prompts(12)
    want = [
        o.outputs[0].token_ids
        for o in offline.generate(ps, SamplingParams(temperature=0.0, max_tokens=5), False)
    ]

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(CONFIG, **OPTS), None, engine_process)
        got = await asyncio.gather(
            *(collect(engine, f"c{i}", p, delta(5)) for i, p in enumerate(ps))
        )
        assert slots_all_free(engine)
        await engine.shutdown()
        return got

    assert run(main()) == want


@MODES
def test_leaving_early_aborts_and_frees_slots(engine_process):
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(CONFIG, **OPTS), None, engine_process)
        # Closed generators and cancelled tasks: both are how a client disconnect arrives.
        early = [collect(engine, f"e{i}", [1, 2, i], delta(40), stop_after=2) for i in range(4)]
        await asyncio.gather(*early)
        tasks = [asyncio.create_task(collect(engine, f"k{i}", [3, i], delta(40))) for i in range(4)]
        await asyncio.sleep(0.5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A full batch of max_num_seqs requests still runs to the end.
        full = await asyncio.gather(*(collect(engine, f"f{i}", [4, i], delta(6)) for i in range(4)))
        assert [len(t) for t in full] == [6] * 4
        for _ in range(50):  # the loop applies aborts between steps
            if engine.num_requests_running == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.num_requests_running == 0
        assert slots_all_free(engine)
        assert not engine.output_processor.requests and not engine.core.has_unfinished_requests()
        await engine.shutdown()

    run(main())


def test_a_failing_request_fails_alone(monkeypatch):
    # The fault is patched into this process's Sampler, so the core runs on the loop's
    # thread here; the same core code fails a request alone in the core process.
    real = Sampler._generator

    def failing(self, request_id, seed):
        if seed == 13:
            raise RuntimeError("injected sampler fault")
        return real(self, request_id, seed)

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(CONFIG, **OPTS), engine_process=False)
        monkeypatch.setattr(Sampler, "_generator", failing)
        bad = SamplingParams(temperature=1.0, seed=13, max_tokens=5, output_kind=DELTA)
        results = await asyncio.gather(
            collect(engine, "ok1", [1, 2], delta(5)),
            collect(engine, "bad", [1, 2], bad),
            collect(engine, "ok2", [3, 4], delta(5)),
            return_exceptions=True,
        )
        assert isinstance(results[1], RequestFailedError)
        assert "injected sampler fault" in str(results[1])
        assert len(results[0]) == len(results[2]) == 5
        monkeypatch.setattr(Sampler, "_generator", real)
        assert len(await collect(engine, "after", [1, 2], delta(3))) == 3
        assert not engine.errored
        await engine.shutdown()

    run(main())


@MODES
def test_bad_requests_are_refused_before_queueing(engine_process):
    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(CONFIG, **OPTS), None, engine_process)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("v", [1, 500], delta(3))
        with pytest.raises(ValueError, match="maximum model length"):
            engine.add_request("l", [1] * 64, delta(3))
        with pytest.raises(ValueError, match="SamplingParams"):
            engine.add_request("p", [1], {"max_tokens": 3})
        stream = engine.add_request("dup", [1, 2], delta(3))
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", [1, 2], delta(3))
        assert len([t async for out in stream for t in out.outputs[0].token_ids]) == 3
        assert not engine.output_processor.requests
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            engine.add_request("gone", [1], delta(1))

    run(main())


def test_the_loop_stats_cover_the_loop_threads_time():
    """With the core on the loop's thread, the records split that thread's time into steps
    (their output processing included), waiting for work (the idle gap between two bursts)
    and the rest: together the wall time of the run, nothing counted twice."""
    records = Records()
    gap_s = 0.5

    async def main():
        engine = AsyncLLM.from_engine_args(EngineArgs(CONFIG, **OPTS), [records], False)
        t0 = time.perf_counter()
        for burst in range(2):
            if burst:
                await asyncio.sleep(gap_s)
            await asyncio.gather(
                *(collect(engine, f"{burst}{i}", [1, i], delta(4)) for i in range(3))
            )
        wall = time.perf_counter() - t0
        await engine.shutdown()
        return wall

    wall = run(main())
    steps = [r.step for r in records.records if r.step is not None]
    assert steps and all(s.total_s >= s.output_s > 0 for s in steps)
    wait = sum(r.loop_wait_s for r in records.records)
    other = sum(r.loop_other_s for r in records.records)
    assert wait >= 0.9 * gap_s and other >= 0
    # The records run from the loop's first wait to its last step's end: inside the wall
    # time, short of it by the thread's start and the last outputs' way to the streams.
    total = sum(s.total_s for s in steps) + wait + other
    assert 0.9 * wall - 0.05 <= total <= wall


def test_the_in_process_client_steps_when_it_has_work_and_waits_for_a_poke_when_idle():
    """The loop's wait on the in-process client: idle, it blocks until a poke and returns
    None; with work it steps at once, a poke or not (the loop took its queue just before,
    so what a poke announces joins the next step)."""
    client = InprocClient(EngineArgs(CONFIG, **OPTS).create_engine_config())
    try:
        client.poke()
        assert client.wait_for_output() is None
        client.add_request(EngineCoreRequest("w", [1, 2], delta(2)))
        client.poke()
        result = client.wait_for_output()
        assert result is not None and result.step is not None
        while client.has_unfinished_requests():
            assert client.wait_for_output() is not None
        threading.Timer(0.3, client.poke).start()
        t0 = time.perf_counter()
        assert client.wait_for_output() is None
        assert time.perf_counter() - t0 >= 0.25
        # That wait is the loop's: it reaches the next step's record.
        client.add_request(EngineCoreRequest("x", [3], delta(1)))
        assert client.wait_for_output().loop_wait_s >= 0.25
    finally:
        client.shutdown()

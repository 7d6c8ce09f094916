"""Late dispatch (``--late-dispatch``, vllm/engine/late_dispatch.py): when the step in
flight may end is estimated only from a decode-only step like it whose device span was
measured; the loop waits only while a new request could join the next step; a request
that arrives in the wait ends it and goes into the very next step; the outputs do not
change; the option needs async scheduling.

On a CPU device no step has a device span (CUDA events), so the engine never waits there
by itself: the CPU cases give the last step read a span of their own to drive the real
loop (InprocClient.wait_for_output). The GPU case serves requests through the core
process with and without the option and asserts that a wait happened and a request
arrived in one, with the same greedy tokens."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from tests.engine.utils import STREAMS_CONFIG as CONFIG
from tests.engine.utils import STREAMS_OPTS as OPTS
from tests.engine.utils import collect, delta
from tests.engine.utils import run_coro as run
from tests.tiny_model import TINY
from vllm.engine import late_dispatch
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.async_llm import AsyncLLM
from vllm.engine.core import EngineCoreRequest, _Dispatched
from vllm.engine.core_client import InprocClient
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import Sequence
from vllm.engine.step_budget import StepTimes
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.sampling_params import SamplingParams
from vllm.step_io import StepOutput

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def _seqs(n: int) -> list[Sequence]:
    return [Sequence(f"r{i}", [1, 2, 3], GREEDY, max_tokens=8) for i in range(n)]


def _step(rows: int, prefill: int = 0, device_s: float | None = 0.007) -> _Dispatched:
    step = _Dispatched(_seqs(rows), [3] * rows, [], handle=None, num_prefill_tokens=prefill)
    step.output = StepOutput([0] * rows, device_s=device_s)
    return step


def test_the_end_is_estimated_only_from_a_like_decode_step():
    est = late_dispatch.step_end_estimate
    assert est(_step(4), _step(4), 100.0) == pytest.approx(100.007)
    assert est(_step(3), _step(4), 100.0) == pytest.approx(100.007)  # a row finished
    assert est(_step(5), _step(4), 100.0) is None  # wider than the step measured
    assert est(_step(4, prefill=9), _step(4), 100.0) is None  # a prefill in flight
    assert est(_step(4), _step(4, prefill=9), 100.0) is None  # measured on a prefill
    assert est(_step(4), _step(4, device_s=None), 100.0) is None  # no CUDA events
    assert est(None, _step(4), 100.0) is None
    assert est(_step(4), None, 100.0) is None
    assert est(_step(4), _step(4), None) is None


def _times(on_device: bool = True) -> StepTimes:
    """Step times fitted to a decode step of 7 ms at 4 decodes and mixed steps of 1 ms +
    20 us per prompt token more."""
    times = StepTimes()
    for _ in range(6):
        times.observe(4, 0, 0.007)
    for p in (100, 300):
        times.observe(4, p, 0.008 + 2e-5 * p)
    times.on_device = on_device
    return times


def _rows(step: _Dispatched, decodes: int) -> _Dispatched:
    step.num_decode_tokens = decodes
    return step


def test_other_steps_are_estimated_from_the_fitted_step_times():
    """A step with prompt tokens in flight, one after a prefill, or one wider than the
    step measured: the fitted times (device spans only), at MODEL_SHARE."""
    est, share = late_dispatch.step_end_estimate, late_dispatch.MODEL_SHARE
    times = _times()
    assert times.step_time(4, 200) == pytest.approx(0.007 + 0.001 + 0.004)
    mixed = _rows(_step(4, prefill=200), 4)
    assert est(mixed, _step(4), 100.0, times) == pytest.approx(100.0 + share * 0.012)
    after = _rows(_step(4), 4)
    assert est(after, _step(4, prefill=9), 100.0, times) == pytest.approx(100.0 + share * 0.007)
    wide = _rows(_step(6), 6)
    assert est(wide, _step(4), 100.0, times) == pytest.approx(100.0 + share * 0.007)
    # The measured span of a like decode step still comes first.
    assert est(after, _step(4, device_s=0.005), 100.0, times) == pytest.approx(100.005)
    # Host-timed fits (a CPU device), no fit yet, or no decodes: nothing is estimated.
    assert est(mixed, _step(4), 100.0, _times(on_device=False)) is None
    assert est(mixed, _step(4), 100.0, StepTimes()) is None
    assert est(_rows(_step(4, prefill=200), 0), _step(4), 100.0, times) is None


def test_a_cpu_engine_fits_host_times_and_never_estimates_from_them(client):
    core = client.engine_core
    core.add_request(EngineCoreRequest("r", [5, 6, 7], GREEDY))
    for _ in range(8):
        client.get_output()
    assert core.step_times.decode.n >= 4 and core.step_times.on_device is False
    core._last_read.output.device_s = None  # no CUDA events: nothing measured either
    assert core.dispatch_deadline() is None


def test_a_wait_only_where_a_new_request_could_join():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=4, kv=None, max_model_len=64)
    assert late_dispatch.can_admit(sched)
    first, second = _seqs(2)
    sched.add(first)
    assert not late_dispatch.can_admit(sched)  # one is queued: it goes first
    sched.schedule()
    assert late_dispatch.can_admit(sched)  # running, a slot and budget left
    sched.add(second)
    sched.schedule()
    assert not late_dispatch.can_admit(sched)  # every slot taken


def _core(client: InprocClient, device_s: float | None = None, ahead_s: float = 0.0):
    """The engine core after two decode steps of one request, the last read given a
    device span (what CUDA events would have measured): ``device_s``, or one that puts the
    deadline ``ahead_s`` after that read returned (on a CPU device the dispatch includes
    the forward, under the interpreter and a loaded machine a large share of a second)."""
    core = client.engine_core
    core.add_request(EngineCoreRequest("long", [5, 6, 7], GREEDY))
    for _ in range(3):
        client.get_output()
    assert core._in_flight is not None and core._last_read is not None
    if device_s is None:
        host = core.last_step.schedule_s + core.last_step.dispatch_s
        device_s = late_dispatch.HOST_FACTOR * host + late_dispatch.MARGIN_S + ahead_s
    core._last_read.output.device_s = device_s
    return core


@pytest.fixture
def client():
    """The real in-thread loop's client of a CPU engine with --late-dispatch."""
    config = EngineArgs(CONFIG, **{**OPTS, "late_dispatch": True}).create_engine_config()
    client = InprocClient(config)
    yield client
    client.shutdown()


def test_deadline_needs_the_option_and_a_step_ahead_of_the_host(client):
    core = _core(client, device_s=30.0)
    last = core.last_step
    host = last.schedule_s + last.dispatch_s
    want = core._read_done_at + 30.0 - late_dispatch.HOST_FACTOR * host - late_dispatch.MARGIN_S
    assert core.dispatch_deadline() == pytest.approx(want)
    assert late_dispatch.deadline(core, now=want + 1e-3) is None  # already past
    core.config.late_dispatch = False
    assert core.dispatch_deadline() is None


def test_an_arrival_ends_the_wait_and_joins_the_next_step(client):
    core = _core(client, device_s=30.0)  # a wait far longer than the test
    t0 = time.perf_counter()
    timer = threading.Timer(0.3, lambda: (core.add_request(
        EngineCoreRequest("late", [9, 9], GREEDY)), client.poke()))  # fmt: skip
    timer.start()
    assert client.wait_for_output() is None  # the poke ended the wait
    waited = time.perf_counter() - t0
    assert 0.25 < waited < 10.0
    result = client.wait_for_output()  # steps at once: the arrival is queued
    assert result is not None and result.late_arrivals == 1
    assert 0.25 < result.late_wait_s < 10.0
    assert result.step.num_prefill_tokens == 2, "the arrival went into this very step"
    timer.join()


def test_without_an_arrival_the_step_goes_at_the_deadline(client):
    core = _core(client, ahead_s=0.6)
    deadline = core.dispatch_deadline()
    assert deadline == pytest.approx(core._read_done_at + 0.6)
    result = client.wait_for_output()
    assert result is not None and result.late_arrivals == 0
    assert time.perf_counter() >= deadline
    assert result.late_wait_s > 0.2


def test_late_dispatch_follows_async_scheduling_and_needs_it():
    def config(**kw):
        return EngineArgs(CONFIG, **{**OPTS, **kw}).create_engine_config()

    assert config().late_dispatch is True  # the default: on with async scheduling
    assert config(async_scheduling=False).late_dispatch is False
    assert config(late_dispatch=False).late_dispatch is False
    with pytest.raises(ValueError, match=r"late_dispatch \(--late-dispatch\) needs async"):
        EngineArgs(
            CONFIG, **{**OPTS, "late_dispatch": True, "async_scheduling": False}
        ).create_engine_config()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; runs on the GPU box")
def test_served_with_late_dispatch_a_request_arrives_in_a_wait():
    """Through the core process, requests added one by one while others decode: every
    request gets all its tokens with and without, and with it a late wait happened and
    requests arrived in one. The tokens are not compared: which requests share a step
    depends on timing in both runs, and bf16 kernels round by batch shape (seen: the same
    first 19 tokens, then apart); the CPU cases pin where an arrival goes."""
    prompts = [[(7 * i + j) % 128 for j in range(2 + i % 5)] for i in range(12)]
    # Codestral-7B's shape (64 layers, bf16, random): a decode step of ~7 ms on the H200,
    # long beside the host's schedule and dispatch (a 1-layer toy's step is not).
    model = Mamba2ModelConfig(**{**TINY, "vocab_size": 128, "hidden_size": 4096,
                                 "num_hidden_layers": 64, "num_heads": 128, "head_dim": 64,
                                 "state_size": 128, "n_groups": 8, "chunk_size": 256})  # fmt: skip
    opts = {**OPTS, "dtype": "bfloat16", "max_num_seqs": 32, "max_num_batched_tokens": 256,
            "max_model_len": 256}  # fmt: skip

    async def serve(late: bool):
        args = EngineArgs(model, **{**opts, "late_dispatch": late})
        engine = AsyncLLM.from_engine_args(args, None, True)
        seen = {"late_wait_s": 0.0, "late_arrivals": 0}

        class Tally:
            def record(self, stats):
                seen["late_wait_s"] += stats.late_wait_s
                seen["late_arrivals"] += stats.late_arrivals

        engine.stat_loggers.append(Tally())
        tasks = []
        for i, p in enumerate(prompts):
            tasks.append(asyncio.create_task(collect(engine, f"q{i}", p, delta(64))))
            # Apart enough that most arrivals fall among decode-only steps: each prefill
            # step runs eagerly here (FULL_DECODE_ONLY), ~40 ms for 64 layers.
            await asyncio.sleep(0.2)
        got = await asyncio.gather(*tasks)
        await engine.shutdown()
        return got, seen

    off, _ = run(serve(False))
    on, seen = run(serve(True))
    assert [len(t) for t in on] == [len(t) for t in off] == [64] * len(prompts)
    assert seen["late_wait_s"] > 0 and seen["late_arrivals"] > 0, seen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; runs on the GPU box")
def test_gpu_the_fitted_step_times_end_a_mixed_step():
    """On CUDA the core fits its step times to device spans, so a step with a prompt chunk
    in flight gets an end (the path the CPU cases reach only with spans set by hand)."""
    config = EngineArgs(CONFIG, **{**OPTS, "late_dispatch": True}).create_engine_config()
    client = InprocClient(config)
    try:
        core = client.engine_core
        core.add_request(EngineCoreRequest("a", [5, 6, 7], GREEDY))
        for _ in range(8):
            client.get_output()
        # 40 prompt tokens beside a's decode in a 16-token budget: three mixed steps.
        core.add_request(EngineCoreRequest("b", list(range(1, 41)), GREEDY))
        ends = []
        for _ in range(6):
            client.get_output()
            step = core._in_flight
            if step is not None and step.num_prefill_tokens:
                end = late_dispatch.step_end_estimate(
                    step, core._last_read, core._read_done_at, core.step_times)  # fmt: skip
                ends.append(None if end is None else end - core._read_done_at)
        times = core.step_times
        assert times.on_device is True and times.decode.n >= 4 and times.mixed.n >= 2
        # H100, the tree of 8478f04: [None, None, None], the tiny model's prompt tokens measured
        # to cost nothing (c <= 0), which then gave no estimate at all.
        fit = (times.decode_time(1), times.mixed.through_origin(), times.mixed.n)
        assert len(ends) == 3 and ends[-1] is not None and ends[-1] > 0, (ends, fit)
    finally:
        client.shutdown()

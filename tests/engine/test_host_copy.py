"""Reading a step's tokens waits for that step only: under async scheduling the step queued
after it keeps the GPU busy while the host applies the tokens and prepares the next one."""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import TINY
from vllm import LLM, SamplingParams
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.worker.host_copy import DeviceSpan, HostCopy

pytestmark = pytest.mark.timeout(600)

CONFIG = Mamba2ModelConfig(**{**TINY, "vocab_size": 128})
# GPU clock cycles of the spin kernel queued behind a step: ~0.1 s at the H200's ~2 GHz,
# far longer than the host's work between two steps of this tiny model.
SLEEP_CYCLES = 200_000_000


def test_cpu_tensors_are_kept_as_they_are():
    a, b = torch.arange(5), torch.ones(2, 3)
    copy = HostCopy([a, b])
    assert not copy.pending
    got = copy.get()
    assert got[0] is a and got[1] is b
    assert DeviceSpan.open(torch.device("cpu")) is None  # no events: no device span


@pytest.mark.gpu
def test_get_waits_for_its_copy_and_not_for_later_work():
    x = torch.arange(1000, device="cuda") * 3
    copy = HostCopy([x, x.float() / 2])
    assert copy.pending
    torch.cuda._sleep(SLEEP_CYCLES)  # queued after the copy
    ints, floats = copy.get()
    assert not torch.cuda.current_stream().query(), "get() waited for the later kernel"
    assert ints.is_pinned() and not ints.is_cuda and ints.dtype == torch.long
    assert ints.tolist() == list(range(0, 3000, 3))
    assert floats.tolist() == [v * 1.5 for v in range(1000)]
    assert not copy.pending
    torch.cuda.synchronize()


def make_llm(async_scheduling: bool) -> LLM:
    return LLM(
        CONFIG,
        load_format="dummy",
        dtype="float32",
        device="cuda",
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
        async_scheduling=async_scheduling,
    )


def run(llm: LLM, steps_busy: list[bool] | None = None) -> dict[str, list[int]]:
    engine = llm.engine
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8, 9, 10], "c": [11] * 20}
    for rid, p in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
        engine.add_request(rid, p, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        reads = engine.engine_core._in_flight is not None  # this step reads the one before
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                assert len(out.outputs[0].logprobs) == 6
        if steps_busy is not None and reads and engine.engine_core._in_flight is not None:
            steps_busy.append(not torch.cuda.current_stream().query())
    return tokens


@pytest.mark.gpu
def test_async_read_leaves_the_next_step_running(monkeypatch):
    want = run(make_llm(async_scheduling=False))
    llm = make_llm(async_scheduling=True)
    core = llm.engine.engine_core
    dispatch = core._dispatch

    def dispatch_then_spin(batch):
        step = dispatch(batch)
        torch.cuda._sleep(SLEEP_CYCLES)  # the step now keeps the GPU busy for ~0.1 s
        return step

    monkeypatch.setattr(core, "_dispatch", dispatch_then_spin)
    busy: list[bool] = []
    got = run(llm, busy)
    assert got == want
    # After every step that read its predecessor, the step it dispatched was still running.
    assert len(busy) >= 5 and all(busy), busy
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_a_step_never_waits_for_the_whole_stream():
    """No stream or device sync anywhere in a step (scheduling, inputs, metadata, forward,
    sampling, the read): ``set_sync_debug_mode("error")`` raises on any of them. Greedy,
    seeded sampling with top-k/top-p, logprobs and prompt logprobs, prefills chunked beside
    decodes."""
    llm = make_llm(async_scheduling=True)
    engine = llm.engine
    prompts = {"g": [1, 2, 3], "s": list(range(5, 30)), "p": [7] * 11, "l": [9, 8, 7, 6]}
    params = {
        "g": SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        "s": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=5),
        "p": SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
        "l": SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True),
    }
    for rid, p in prompts.items():
        engine.add_request(rid, p, params[rid])
    finished = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(finished) == sorted(prompts)
    for rid, out in finished.items():
        assert out.outputs[0].finish_reason in ("length", "stop"), (rid, out)
    assert len(finished["p"].prompt_logprobs) == len(prompts["p"])
    assert len(finished["l"].outputs[0].logprobs) == 4


def spin_seconds() -> float:
    """The spin kernel's duration on this GPU, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.gpu
def test_device_span_is_the_steps_own_device_time(monkeypatch):
    """``StepStats.device_s`` (the server's vllm:engine_step_device_seconds) spans the step's
    device work: a spin queued inside the step (before its forward) is in every span; the
    same spin queued after the step (before the next one) is in none."""
    llm = make_llm(async_scheduling=True)
    core, engine = llm.engine.engine_core, llm.engine
    spin = spin_seconds()
    execute, dispatch = engine.runner.execute_inputs, core._dispatch

    def spin_inside(*args, **kwargs):
        torch.cuda._sleep(SLEEP_CYCLES)
        return execute(*args, **kwargs)

    def spin_after(batch):
        step = dispatch(batch)
        torch.cuda._sleep(SLEEP_CYCLES)
        return step

    means = {}
    for where, obj, name, fn in (
        ("inside", engine.runner, "execute_inputs", spin_inside),
        ("after", core, "_dispatch", spin_after),
    ):
        before = engine.step_totals.as_dict()
        with monkeypatch.context() as m:
            m.setattr(obj, name, fn)
            run(llm)
        after = engine.step_totals.as_dict()
        steps = after["steps"] - before["steps"]
        spans = after["device_steps"] - before["device_steps"]
        assert spans >= steps - 1 and spans >= 5, (steps, spans)  # the first read nothing
        means[where] = (after["device_s"] - before["device_s"]) / spans
    torch.cuda.synchronize()
    assert means["inside"] >= 0.9 * spin, (means, spin)
    assert means["after"] < 0.5 * spin, (means, spin)

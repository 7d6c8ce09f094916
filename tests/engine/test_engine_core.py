"""The engine core: deltas every step, atomic admission, failures that stay with their
request, aborts that free slots, and no slot leaks over many random requests."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.models.mamba2_utils import TINY
from vllm import LLM, SamplingParams
from vllm.executor.uniproc import UniprocExecutor
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
from vllm.sampling_params import RequestOutputKind
from vllm.worker.sampler import Sampler

pytestmark = pytest.mark.timeout(600)

CONFIG = Mamba2ModelConfig(**{**TINY, "vocab_size": 128})
VOCAB = CONFIG.vocab_size
# The same model with one layer: for the test of many requests, where what is checked is
# the engine's bookkeeping (slots, requests, outputs), which a second layer leaves as it is
# while doubling the cost of every step under the interpreter.
ONE_LAYER = Mamba2ModelConfig(**{**TINY, "vocab_size": 128, "num_hidden_layers": 1})


def make_llm(device, config=CONFIG, **kwargs) -> LLM:
    opts = dict(
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    return LLM(config, **{**opts, **kwargs})


@pytest.fixture(scope="module")
def llm():
    import torch

    return make_llm(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def greedy(n=4, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.slots.num_used == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.engine_core.requests and not engine.output_processor.requests


def test_step_returns_a_delta_of_every_running_request(llm):
    engine = llm.engine
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, greedy(5, output_kind=RequestOutputKind.DELTA))
    seen: dict[str, list[int]] = {f"d{i}": [] for i in range(3)}
    steps_with_all = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            assert len(out.outputs[0].token_ids) <= 1  # one new token per step, a delta
            seen[out.request_id] += out.outputs[0].token_ids
        steps_with_all += len({o.request_id for o in outs}) == 3
    # Every request took one token per step (three prompts of one step each: in lockstep).
    assert steps_with_all >= 4
    alone = tokens(llm.generate(prompts, greedy(5), use_tqdm=False))
    assert list(seen.values()) == alone
    assert_idle(llm)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([999], greedy(), "outside the vocabulary"),
        ([-1], greedy(), "outside the vocabulary"),
        (None, greedy(), "string or a list of token ids"),
        ([1, None], greedy(), "position 1"),
        ([1, 2.7], greedy(), "position 1"),
        ([1, True], greedy(), "position 1"),
        ([], greedy(), "no tokens"),
        ("", greedy(), "empty"),
        ([1] * 300, greedy(), "maximum model length"),
        ([1, 2], {"temperature": 0.0}, "SamplingParams"),
        ([1, 2], SamplingParams(logprobs=21), "logprobs"),
    ],
    ids=[
        "out_of_vocab",
        "negative_id",
        "none_prompt",
        "none_id",
        "float_id",
        "bool_id",
        "empty_ids",
        "empty_text",
        "too_long",
        "dict_params",
        "too_many_logprobs",
    ],
)
def test_a_rejected_call_leaves_nothing_behind(llm, prompt, params, match):
    good = [1, 2, 3]
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], [greedy(), params], use_tqdm=False)
    assert_idle(llm)
    # The engine still serves, and the good prompt was not left queued.
    outs = llm.generate([good], greedy(), use_tqdm=False)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 4
    assert_idle(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_valid_edges_are_accepted():
    SamplingParams(seed=2**64 - 1)
    SamplingParams(seed=-(2**63))
    SamplingParams(max_tokens=None, top_k=0, top_p=1.0, temperature=0)
    SamplingParams(stop_token_ids=(1, 2), stop="x")


def test_a_sampling_failure_fails_only_its_request(llm, monkeypatch):
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    params = [greedy(6), SamplingParams(temperature=0.8, seed=7, max_tokens=6), greedy(6)]
    want = tokens(llm.generate(prompts, params, use_tqdm=False))
    real = Sampler._generator
    calls = {"n": 0}

    def failing(self, request_id, seed):
        if seed == 7:
            calls["n"] += 1
            if calls["n"] >= 3:  # mid-generation, not at admission
                raise RuntimeError("injected sampler fault")
        return real(self, request_id, seed)

    monkeypatch.setattr(Sampler, "_generator", failing)
    outs = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(Sampler, "_generator", real)
    assert outs[1].outputs[0].finish_reason == "error"
    assert "injected sampler fault" in outs[1].error
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [want[0], want[2]]
    assert outs[0].error is None and outs[2].error is None
    assert_idle(llm)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want


def test_a_detokenizing_failure_fails_only_its_request(llm, monkeypatch):
    tok = llm.get_tokenizer()
    prompts = [[1, 2, 3], [9, 9]]
    want = tokens(llm.generate(prompts, greedy(5), use_tqdm=False))
    bad = want[1][2]  # a token only the second request makes at that point
    assert bad not in want[0], "pick another token: the first request makes it too"
    real = type(tok).decode

    def decode(self, ids):
        if ids and ids[-1] == bad:
            raise UnicodeError("injected detokenizer fault")
        return real(self, ids)

    monkeypatch.setattr(type(tok), "decode", decode)
    outs = llm.generate(prompts, greedy(5), use_tqdm=False)
    monkeypatch.setattr(type(tok), "decode", real)
    assert outs[1].outputs[0].finish_reason == "error" and "detokenizer" in outs[1].error
    assert outs[0].outputs[0].token_ids == want[0]
    assert_idle(llm)


def test_abort_frees_the_slot_at_once(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"a{i}", [1 + i, 2, 3], greedy(50))
    engine.step()
    engine.step()
    assert engine.scheduler.slots.num_used == 4
    engine.abort_request(["a1", "a2", "unknown"])
    assert engine.scheduler.slots.num_used == 2
    engine.add_request("late", [5, 6], greedy(3))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in ("a1", "a2")
            done[out.request_id] = out
        if "late" in done and done["late"].finished:
            engine.abort_request(["a0", "a3"])
    assert (
        done["late"].outputs[0].token_ids
        == tokens(llm.generate([[5, 6]], greedy(3), use_tqdm=False))[0]
    )
    assert_idle(llm)


def test_no_slot_leaks_over_many_random_requests_and_aborts(device, monkeypatch):
    """Thousands of requests with aborts, then no slot, block or request is left. The
    bookkeeping is what is tested, so on the CPU the kernels run as their PyTorch
    references (TRITON_INTERPRET=0: the interpreter costs a sixth of a second a step)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = make_llm(device, ONE_LAYER, max_num_seqs=8, max_num_batched_tokens=24)
    engine = llm.engine
    rng = random.Random(0)
    live: set[str] = set()
    finished = aborted = 0
    next_id = 0
    total = 3000 if device.type == "cuda" else 1000
    while next_id < total or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 6)):
            if next_id >= total:
                break
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
            params = SamplingParams(
                temperature=rng.choice([0.0, 1.0]),
                max_tokens=rng.randint(1, 4),
                n=rng.choice([1, 1, 1, 2]),
                seed=rng.choice([None, rng.randrange(1000)]),
                stop_token_ids=[rng.randrange(VOCAB)],
            )
            engine.add_request(f"s{next_id}", prompt, params)
            live.add(f"s{next_id}")
            next_id += 1
        if live and rng.random() < 0.3:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
            aborted += 1
        for out in engine.step():
            assert out.request_id in live, f"output of a request not running: {out.request_id}"
            assert out.error is None
            if out.finished:
                live.discard(out.request_id)
                finished += 1
        used = engine.scheduler.slots.num_used
        assert used == len(engine.scheduler.running) <= 8
    assert finished + aborted == total and aborted > total // 15
    assert_idle(llm)


def test_get_model_imports_where_readme_says():
    from vllm.model_executor.models import get_model

    assert callable(get_model)


def test_aborts_and_finishes_are_counted_in_stats(llm):
    from vllm.engine.stats import IterationStats

    engine = llm.engine
    engine.add_request("st0", [1, 2, 3], greedy(2))
    engine.add_request("st1", [4, 5], greedy(30))
    seen = IterationStats()
    while seen.num_prompt_tokens < 5:  # both prompts' first tokens read
        engine.step(seen)
    engine.abort_request("st1", seen)
    while engine.has_unfinished_requests():
        engine.step(seen)
    reasons = sorted(f.finish_reason for f in seen.finished)
    assert reasons == ["abort", "length"]
    assert seen.num_prompt_tokens == 5 and seen.num_generation_tokens >= 3
    assert_idle(llm)


def _host_only(value) -> bool:
    """Plain host data all the way down: no tensor anywhere."""
    if dataclasses.is_dataclass(value):
        return all(_host_only(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, list | tuple):
        return all(_host_only(v) for v in value)
    if isinstance(value, dict):
        return all(_host_only(k) and _host_only(v) for k, v in value.items())
    return value is None or isinstance(value, int | float | str)


def test_every_step_goes_through_the_executor_as_host_data(llm, monkeypatch):
    """One dispatch path: at TP = 1 too the core hands each step to its executor (one
    worker in this process) as plain host lists, and applies the plain host output that
    the step's handle gives, one step later under async scheduling."""
    core = llm.engine.engine_core
    assert isinstance(core.executor, UniprocExecutor)
    real, calls, outputs = core.executor.execute_model, [], []

    def spy(inputs):
        calls.append(inputs)
        handle = real(inputs)
        get = handle.get

        def noted_get():
            outputs.append(get())
            return outputs[-1]

        handle.get = noted_get
        return handle

    monkeypatch.setattr(core.executor, "execute_model", spy)
    steps = core.num_steps
    params = greedy(3, logprobs=2, prompt_logprobs=1)
    outs = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
    assert [len(t) for t in tokens(outs)] == [3, 3]
    assert len(calls) == core.num_steps - steps == 3
    assert len(outputs) == 3  # every dispatched step read, once
    assert all(_host_only(inp) for inp in calls)
    assert all(_host_only(out) for out in outputs)
    assert calls[0].sampling.request_ids and calls[0].sampling.prompt_k == 1
    assert_idle(llm)

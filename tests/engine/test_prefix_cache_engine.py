"""Prefix caching in the engine (pure Mamba2, end-of-request checkpoints): a request whose
prompt extends a finished one's prompt + output restores its state (the counters say so)
and gives the greedy tokens and logprobs of the engine without caching (fp32)."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry

from tests.engine.utils import ASYNC_SCHED_CONFIG as CONFIG
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.engine.metrics import PrometheusStatLogger
from vllm.engine.stats import IterationStats, StepStats, startup_line

pytestmark = pytest.mark.timeout(900)
BLOCK = 4
OTHER = [90, 2, 2, 61, 33, 7]  # an unrelated prompt


def make_llm(device, cache: bool, async_scheduling: bool, **kw) -> LLM:
    return LLM(
        CONFIG,
        load_format="dummy",
        dtype="float32",
        device=device.type,
        max_num_seqs=2,
        max_num_batched_tokens=6,  # chunked prompts: chunk ends on and off the block grid
        async_scheduling=async_scheduling,
        enable_prefix_caching=cache,
        mamba_block_size=BLOCK,
        **kw,
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def run(llm: LLM, prompt: list[int], n: int, cached: int = 0):
    """Greedy tokens and their logprobs; ``cached``: the prompt tokens the request must
    report restored (``RequestOutput.num_cached_tokens``)."""
    req = llm.generate([{"prompt_token_ids": prompt}], greedy(n), use_tqdm=False)[0]
    assert req.num_cached_tokens == cached
    out = req.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    return list(out.token_ids), lps


def test_flags_parse_and_validate():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--enable-prefix-caching", "--mamba-block-size", "8"])
    ns.model = CONFIG
    config = EngineArgs.from_cli_args(ns).create_engine_config()
    assert config.enable_prefix_caching and config.mamba_block_size == 8
    assert config.num_checkpoint_lines is None  # the worker sizes it (cache_engine.py)
    default = EngineArgs(CONFIG, device="cpu").create_engine_config()
    assert default.enable_prefix_caching is None and default.num_checkpoint_lines is None
    ns = parser.parse_args(["--no-enable-prefix-caching"])
    ns.model = CONFIG
    off = EngineArgs.from_cli_args(ns).create_engine_config()
    assert off.enable_prefix_caching is False and off.num_checkpoint_lines == 0
    for name, bad in (
        ("mamba_block_size", 0),
        ("num_checkpoint_lines", 0),
        ("enable_prefix_caching", "yes"),
    ):
        kw = {"enable_prefix_caching": True, name: bad}
        with pytest.raises(ValueError, match=name):
            EngineArgs(CONFIG, device="cpu", **kw).create_engine_config()


@pytest.mark.parametrize("async_scheduling,replay", [(False, False), (True, False), (False, True)])
def test_next_turn_restores_the_finished_request(device, async_scheduling, replay):
    # With replayed decode the finished request's line has decode steps in its ring.
    replay_kw = dict(use_replayssm=True, replayssm_buffer_len=3) if replay else {}
    first = [5, 17, 3, 3, 40, 9, 71]
    # The cold flag: the first prompt is new, and its align checkpoint is what the second
    # request's checkpoint must evict instead of the end-of-request one.
    on = make_llm(device, True, async_scheduling, enable_mamba_align_cold_checkpoint=True,
                  **replay_kw)  # fmt: skip
    core = on.llm_engine.engine_core
    # No num_checkpoint_lines given: the worker made one line per sequence (a CPU device).
    assert on.llm_engine.startup["num_checkpoint_lines"] == 2
    index = core.prefix.index
    out1, _ = run(on, first, 5)
    assert index.hits == 0 and index.queries == len(first)
    # The finished request's state covers its prompt and all but its last output token;
    # the budget cut the first chunk (6 of 7 tokens) and align rounded it to 4: a second.
    assert len(index) == 2
    # Another request takes the freed slot (lowest first) and overwrites its state, so the
    # second turn's state can only come from the checkpoint.
    run(on, OTHER, 2)
    # Its checkpoint took the oldest of the two lines (align's): the end one is kept.
    assert len(index) == 2 and index.hits == 0 and index.evictions == 1
    second = first + out1 + [12, 60, 2]
    restored = len(first) + len(out1) - 1
    out2, lps2 = run(on, second, 4, cached=restored)
    assert index.hits == restored, "the second turn did not hit the cache"
    assert index.queries == len(first) + len(OTHER) + len(second)

    off = make_llm(device, False, async_scheduling, **replay_kw)
    assert off.llm_engine.engine_core.prefix is None
    ref1, _ = run(off, first, 5)
    ref2, ref_lps2 = run(off, second, 4)
    assert out1 == ref1
    assert out2 == ref2
    assert lps2 == pytest.approx(ref_lps2, rel=1e-4, abs=1e-5)


def test_a_prompt_one_token_past_the_checkpoint_restores_to_a_decode_row(device):
    # The restored prefix leaves one prompt token: the row is a one-token continuation.
    on = make_llm(device, True, False)
    index = on.llm_engine.engine_core.prefix.index
    first = [8, 1, 30, 30, 30]
    out1, _ = run(on, first, 3)
    run(on, OTHER, 2)  # overwrites the freed slot
    second = first + out1  # state covers all but out1[-1]: exactly one token to compute
    out2, lps2 = run(on, second, 3, cached=len(second) - 1)
    assert index.hits == len(second) - 1
    off = make_llm(device, False, False)
    run(off, first, 3)
    ref2, ref_lps2 = run(off, second, 3)
    assert out2 == ref2
    assert lps2 == pytest.approx(ref_lps2, rel=1e-4, abs=1e-5)


def test_step_stats_reach_the_prometheus_counters():
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry)
    step = StepStats(prefix_cache_queries=10, prefix_cache_hits=7)
    logger.record(IterationStats(step=step))
    logger.record(IterationStats(step=StepStats(prefix_cache_queries=5)))
    labels = {"model_name": "m"}
    assert registry.get_sample_value("vllm:prefix_cache_queries_total", labels) == 15
    assert registry.get_sample_value("vllm:prefix_cache_hits_total", labels) == 7


def test_a_one_line_budget_evicts_the_older_checkpoint(device):
    on = make_llm(device, True, False, num_checkpoint_lines=1)
    index = on.llm_engine.engine_core.prefix.index
    first = [8, 1, 30, 30, 30]
    out1, _ = run(on, first, 3)
    run(on, OTHER, 2)  # its checkpoint takes the only line
    assert index.evictions == 1 and len(index) == 1
    second = first + out1 + [4]
    out2, lps2 = run(on, second, 2, cached=0)  # evicted: a full prefill, no stale restore
    # align's checkpoint at 4 (its first chunk, cut by the budget), then the second
    # request's own end-of-request checkpoint took the line
    assert index.evictions == 3
    third = second + out2 + [9]
    run(on, third, 1, cached=len(second) + len(out2) - 1)  # the newest checkpoint hits
    off = make_llm(device, False, False)
    run(off, first, 3)
    ref2, ref_lps2 = run(off, second, 2)
    assert out2 == ref2
    assert lps2 == pytest.approx(ref_lps2, rel=1e-4, abs=1e-5)


def test_two_requests_in_one_batch_restore_the_same_checkpoint(device):
    on = make_llm(device, True, True)
    index = on.llm_engine.engine_core.prefix.index
    first = [8, 1, 30, 30, 30, 6]
    out1, _ = run(on, first, 3)
    run(on, OTHER, 2)  # overwrites the freed slot
    prompts = [first + out1 + [4], first + out1 + [50, 51, 52]]
    params = greedy(3)
    outs = on.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    restored = len(first) + len(out1) - 1
    assert [o.num_cached_tokens for o in outs] == [restored, restored]
    assert index.hits == 2 * restored
    off = make_llm(device, False, True)
    refs = off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, r in zip(outs, refs, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        lps = [
            lp[t].logprob
            for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
        ]
        ref = [
            lp[t].logprob
            for t, lp in zip(r.outputs[0].token_ids, r.outputs[0].logprobs, strict=True)
        ]
        assert lps == pytest.approx(ref, rel=1e-4, abs=1e-5)


def test_startup_line_gives_the_checkpoint_budget(device):
    llm = make_llm(device, True, False, num_checkpoint_lines=3)
    pool = llm.llm_engine.engine_core.executor.driver_worker.runner.pool
    assert pool.num_slots == 2 + 3  # max_num_seqs lines, then the checkpoint lines
    startup = llm.llm_engine.startup
    assert startup["checkpoint_gib"] == pytest.approx(pool.nbytes() * 3 / 6 / 2**30)
    assert "3 prefix-cache checkpoint lines" in startup_line(startup)
    off = make_llm(device, False, False).llm_engine.startup
    assert "checkpoint" not in startup_line(off)

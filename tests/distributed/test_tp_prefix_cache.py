"""Prefix caching over two tensor-parallel ranks (CPU, gloo): each rank copies its own
heads' state lines (and, for the hybrids, its own heads' KV blocks), so a second turn
restored from the first's checkpoint gives the greedy tokens of one rank without caching,
and the cache was hit.

Hybrids (tiny random Bamba, NemotronH, Zamba2 saved with transformers' save_pretrained):
one TP=2 engine with caching, one TP=2 engine without and one TP=1 engine with caching per
model (module fixture, shared by its two tests); each case runs on all three and asserts
the hits (``num_cached_tokens``, ``index.hits``: the counters ``/metrics`` exports), the
restore's copies sent to the ranks, and greedy tokens and logprobs equal across the three.
The kernels run as their PyTorch references (TRITON_INTERPRET=0), unlike the other
tests/distributed modules': the per-rank copies and the bookkeeping are what is tested
here (the kernels under TP are those modules', a restored prefill under the interpreter
tests/engine/test_prefix_cache_hybrid.py's). Under the interpreter these tests pass too,
but take 55 s (NemotronH) to 120 s (Zamba2) a model instead of 6 to 9 s (checked)."""

from __future__ import annotations

import pytest

from tests.models.hf_builders import make_bamba_hf, make_nemotron_h_hf, make_zamba2_hf
from tests.models.hybrid_utils import save_checkpoint
from tests.tiny_model import make_tiny_model_dir
from vllm import LLM, SamplingParams
from vllm.engine.prefix_cache import hash_blocks

ENGINE = dict(device="cpu", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _turn(llm: LLM, prompt: list[int]):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_two_ranks_restore_the_first_turn(tmp_path):
    model_dir = str(make_tiny_model_dir(tmp_path / "tiny", n_groups=2))
    first, other = [5, 9, 13, 17, 21, 25, 29], [40, 2, 2, 7]
    llm = LLM(
        model_dir,
        tensor_parallel_size=2,
        enable_prefix_caching=True,
        mamba_block_size=4,
        **ENGINE,
    )
    try:
        assert llm.engine.engine_core.executor.world_size == 2
        out1, cached1 = _turn(llm, first)
        _turn(llm, other)  # takes the freed slot, so only the checkpoint holds turn one
        second = first + out1 + [3, 3]
        out2, cached2 = _turn(llm, second)
        assert (cached1, cached2) == (0, len(first) + len(out1) - 1)
    finally:
        llm.engine.core.shutdown()
    ref = LLM(model_dir, **ENGINE)
    assert _turn(ref, first)[0] == out1
    assert _turn(ref, second)[0] == out2


# --- hybrids ---------------------------------------------------------------------------

ATTN_BLOCK = 8  # attention blocks: a restored 11 or 12 tokens is one full block + a tail
HYBRID_ENGINE = dict(
    dtype="float32",
    device="cpu",
    max_num_seqs=2,
    max_num_batched_tokens=16,
    max_model_len=64,
    block_size=ATTN_BLOCK,
    mamba_block_size=4,
    num_checkpoint_lines=8,  # no checkpoint is evicted in these tests
    enforce_eager=True,
)
# (checkpoint maker, async scheduling): both schedulings, as in test_prefix_cache_hybrid.py
HYBRIDS = {
    "bamba": (make_bamba_hf, False),
    "nemotron_h": (make_nemotron_h_hf, True),
    "zamba2": (make_zamba2_hf, True),
}
# name: (tensor_parallel_size, enable_prefix_caching)
ENGINES = {"tp2_on": (2, True), "tp2_off": (2, False), "tp1_on": (1, True)}
# Multi-turn: turn 2 = turn 1's prompt + its 5 tokens + new ones restores 7 + 5 - 1 tokens.
FIRST, TURN_RESTORED = [5, 17, 3, 3, 40, 9, 71], 11
# Shared prompt: 13 tokens, the junction at 12 (the deepest boundary of 4 short of it).
SHARED, JUNCTION = [101, 57, 3, 3, 40, 9, 71, 8, 8, 2, 44, 6, 19], 12


def _run(llm: LLM, prompt: list[int], n: int):
    """(greedy tokens, their logprobs, the prompt tokens restored)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    req = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    out = req.outputs[0]
    lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
    return list(out.token_ids), lps, req.num_cached_tokens


def _counts(core) -> tuple[int, int, int]:
    """Restored tokens (``index.hits``: /metrics' vllm:prefix_cache_hits_total), prompt
    chunks cut at a checkpoint target, prompt checkpoints written."""
    if core.prefix is None:
        return 0, 0, 0
    policy = core.prompt_checkpoints
    return core.prefix.index.hits, policy.num_cuts, policy.num_written


def _observe(llm: LLM, steps: list, last: list[int]) -> dict:
    """Runs ``last``; keeps its outputs, the StepInputs sent to the ranks from its
    admission on, the counters after it, and the cached block named by the chain hash of
    ``last``'s first attention block."""
    core, before = llm.llm_engine.engine_core, len(steps)
    out = _run(llm, last, 3)
    kv = core.scheduler.kv
    shared = kv.block_of(hash_blocks(last, ATTN_BLOCK)[0]) if core.prefix else None
    return dict(out=out, steps=steps[before:], after=_counts(core), shared=shared)


def _scenarios(llm: LLM, steps: list) -> dict:
    """Both cases on one engine, each with an unrelated request before its restoring one
    (it takes the freed slot and blocks, overwriting them)."""
    core = llm.llm_engine.engine_core
    c0 = _counts(core)
    out1 = _run(llm, FIRST, 5)
    _run(llm, [90, 2, 2, 61, 33, 7], 2)
    turn = dict(outs=[out1], before=c0, **_observe(llm, steps, FIRST + out1[0] + [12, 60, 2]))
    c0 = _counts(core)
    outs = [_run(llm, SHARED + q, 3) for q in ([20, 21], [30, 31, 32])]
    _run(llm, [88, 14, 14, 2, 9], 2)
    shared = dict(outs=outs, before=c0, **_observe(llm, steps, SHARED + [40]))
    return {"next_turn": turn, "junction": shared}


@pytest.fixture(scope="module", params=list(HYBRIDS))
def hybrid(request, tmp_path_factory):
    """Per engine (one TP=2 engine at a time: rank 0 is this process), the observations of
    ``_scenarios``."""
    make, async_scheduling = HYBRIDS[request.param]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")  # inherited by the spawned rank
        path = str(save_checkpoint(make(seed=4), tmp_path_factory.mktemp(request.param)))
        seen = {}
        for name, (tp, cache) in ENGINES.items():
            llm = LLM(path, tensor_parallel_size=tp, enable_prefix_caching=cache,
                      async_scheduling=async_scheduling, **HYBRID_ENGINE)  # fmt: skip
            try:
                executor = llm.llm_engine.engine_core.executor
                assert getattr(executor, "world_size", 1) == tp
                execute, steps = executor.execute_model, []

                def record(inputs, execute=execute, steps=steps):
                    steps.append(inputs)
                    return execute(inputs)

                executor.execute_model = record
                seen[name] = _scenarios(llm, steps)
            finally:
                if tp > 1:
                    llm.llm_engine.core.shutdown()
    return seen


def _check(seen: dict, case: str, restored: int, cuts: int) -> None:
    """With caching (both TP sizes): the last request restored ``restored`` tokens, the
    only hit (``num_cached_tokens``, the hits counter); the prompt-checkpoint counters
    moved by ``cuts``; its first step copied a state line and its tail KV block (cached
    tail -> a fresh block after the shared full one), and no later step copied a block.
    Without: nothing restored. Greedy tokens equal across the three engines, logprobs
    within fp32 rounding (another chunking, another order of the ranks' partial sums: up
    to 3.6e-5 seen, Zamba2's; a KV copy skipped on one rank, where the tokens still
    agree, moves them by 0.07 to 0.7)."""
    for name, (_, cache) in ENGINES.items():
        got = seen[name][case]
        cached = [o[2] for o in got["outs"]] + [got["out"][2]]
        if not cache:
            assert cached == [0] * len(cached)
            continue
        assert cached == [0] * (len(cached) - 1) + [restored], f"{name}: no hit"
        now = tuple(a - b for a, b in zip(got["after"], got["before"], strict=True))
        assert now == (restored, cuts, cuts), f"{name}: counters moved by {now}"
        first = got["steps"][0]  # the restoring sequence alone, from its restored context
        assert (first.slots, first.contexts) == ([first.slots[0]], [restored])
        # the restore is queued after the write of the unrelated request's checkpoint
        (src, dst) = first.state_copies[-1]
        assert dst == first.slots[0] and src > HYBRID_ENGINE["max_num_seqs"], "no restore"
        assert len(first.kv_copies) == 1, f"{name}: the cached tail block was not copied"
        (tail, fresh), table = first.kv_copies[0], first.block_tables[0]
        assert table[0] == got["shared"] and table[1] == fresh != tail
        assert not any(s.kv_copies for s in got["steps"][1:])
    for name in ("tp2_off", "tp1_on"):
        for ours, ref in zip(_outs(seen["tp2_on"][case]), _outs(seen[name][case]), strict=True):
            assert ours[0] == ref[0], f"greedy tokens differ from {name}"
            assert ours[1] == pytest.approx(ref[1], rel=1e-4, abs=1e-5), name


def _outs(got: dict) -> list:
    return got["outs"] + [got["out"]]


@pytest.mark.timeout(120)
def test_hybrid_next_turn_restores_on_two_ranks(hybrid):
    """Turn 2 = turn 1's prompt + its answer + new tokens restores the 11 tokens turn 1's
    finish checkpointed: the Mamba line on every rank, one full KV block shared, the tail
    block copied in every rank's heads."""
    _check(hybrid, "next_turn", TURN_RESTORED, 0)


@pytest.mark.timeout(120)
def test_hybrid_shared_prompt_junction_restores_on_two_ranks(hybrid):
    """A shared 13-token prompt S: r1 = S + q1 runs whole; r2 = S + q2 is cut at the
    junction (12, the deepest block boundary seen before), which is written (the Mamba
    line, its KV blocks named); r3 = S + q3 restores those 12 tokens (one full KV block
    shared, a tail of 4 copied)."""
    _check(hybrid, "junction", JUNCTION, 1)

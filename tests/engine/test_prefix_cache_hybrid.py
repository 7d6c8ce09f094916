"""Prefix caching of hybrids in the engine (tiny random Bamba, Zamba2, NemotronH, Jamba, LFM2,
GraniteMoeHybrid, FalconH1; fp32): the second turn of a conversation restores its Mamba
checkpoint and shares the first turn's attention KV blocks (the full ones by reference, the
partial last one by a queued copy), and gives the greedy tokens and logprobs of the engine
without caching; under a tiny KV budget the cached blocks are reclaimed and the outputs stay
equal."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.hybrid_prefix_utils import (
    ATTN_BLOCK,
    FIRST,
    OTHER,
    make_llm,
    reference_engines,
    run,
    same,
)
from tests.engine.utils import recording
from vllm import SamplingParams
from vllm.engine.prefix_cache import hash_blocks

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def reference():
    """The engines without caching, one per model, shared by the tests."""
    return reference_engines()


@pytest.mark.parametrize(
    "model,async_scheduling",
    [("bamba", False), ("zamba2", True), ("nemotron_h", True), ("jamba", False), ("lfm2", True),
     ("granitemoehybrid", False), ("falcon_h1", True)],
)  # fmt: skip
def test_next_turn_shares_the_first_turns_kv_blocks(device, reference, model, async_scheduling):
    on = make_llm(device, model, True, async_scheduling=async_scheduling)
    core = on.llm_engine.engine_core
    kv, index = core.scheduler.kv, core.prefix.index
    out1 = run(on, FIRST, 5)
    # Its state and KV cover the prompt and all but the last output: 11 tokens, one full
    # attention block and a tail of 3.
    tokens = FIRST + out1[0][:-1]
    full = kv.block_of(hash_blocks(tokens, ATTN_BLOCK)[0])
    tail = kv.block_of(kv.tail_hash(tokens, 11, hash_blocks(tokens, ATTN_BLOCK)))
    assert full is not None and tail is not None and kv.num_cached_blocks == 2
    # Another request takes the freed slot and free blocks and overwrites the slot's state.
    run(on, OTHER, 2)
    steps = recording(on)
    second = FIRST + out1[0] + [12, 60, 2]
    out2 = run(on, second, 4, cached=11)
    assert index.hits == 11, "the second turn did not hit the cache"
    table = steps[0].block_tables[0]
    assert table[0] == full, "the first block is not shared"
    assert steps[0].kv_copies == [(tail, table[1])], "the tail block was not copied"
    assert table[1] != tail
    assert all(not s.kv_copies for s in steps[1:])
    kv.check()
    assert kv.num_reserved == 0 and all(kv.refs_of(b) == 0 for b in range(kv.num_blocks))

    off = reference(model)
    same(out1, run(off, FIRST, 5))
    same(out2, run(off, second, 4))


def test_a_hit_on_the_attention_grid_copies_nothing(device, reference):
    # 16 restored tokens: two full attention blocks, no tail to copy.
    on = make_llm(device, "bamba", True, async_scheduling=False)
    kv = on.llm_engine.engine_core.scheduler.kv
    first = [8, 1, 30, 30, 30, 6, 7, 8, 9, 10, 11, 12]
    out1 = run(on, first, 5)  # 12 + 4 computed = 16 tokens
    run(on, OTHER, 2)
    steps = recording(on)
    second = first + out1[0] + [3]
    out2 = run(on, second, 3, cached=16)
    hashes = hash_blocks(second, ATTN_BLOCK)
    assert steps[0].block_tables[0][:2] == [kv.block_of(h) for h in hashes[:2]]
    assert not any(s.kv_copies for s in steps)
    same(out2, run(reference("bamba"), second, 3))


@pytest.mark.parametrize("model", ["bamba", "granitemoehybrid", "falcon_h1"])
def test_a_shared_prefix_junction_names_the_running_sequences_blocks(device, reference, model):
    """A shared system prompt S (13 tokens) on a hybrid: r1 = S + q1 runs whole; r2 = S + q2
    cuts its prefill at the junction (12, the deepest block boundary seen before), writes
    the Mamba checkpoint there and names its KV blocks up to it while it runs (one full
    attention block, a tail of 4 in the next); r3 = S + q3 restores 12 tokens: the full
    block shared, the tail copied; all equal caching off."""
    on = make_llm(device, model, True, async_scheduling=False, max_num_batched_tokens=16)
    core = on.llm_engine.engine_core
    kv, policy = core.scheduler.kv, core.prompt_checkpoints
    shared = [5, 17, 3, 3, 40, 9, 71, 8, 8, 2, 44, 6, 19]
    r1, r2, r3 = shared + [20, 21], shared + [30, 31, 32], shared + [40]
    out1 = run(on, r1, 3)
    assert policy.num_cuts == 0 and policy.num_written == 0
    out2 = run(on, r2, 3)
    assert policy.num_cuts == 1 and policy.num_written == 1, "no junction checkpoint"
    hashes = hash_blocks(shared[:12], ATTN_BLOCK)
    full = kv.block_of(hashes[0])
    tail = kv.block_of(kv.tail_hash(shared, 12, hashes))
    assert full is not None and tail is not None, "r2's blocks were not named at the junction"
    steps = recording(on)
    out3 = run(on, r3, 3, cached=12)
    table = steps[0].block_tables[0]
    assert table[0] == full and steps[0].kv_copies == [(tail, table[1])]
    assert core.prefix.index.hits == 12
    kv.check()
    off = reference(model)
    for prompt, out in ((r1, out1), (r2, out2), (r3, out3)):
        same(out, run(off, prompt, 3))


def test_a_tiny_kv_budget_reclaims_cached_blocks(device, reference):
    # Five blocks of 8: one max_model_len sequence. The long unrelated request needs four
    # blocks, so it evicts the first turn's tail (the oldest cached block): the second turn
    # misses (its Mamba checkpoint alone is not a hit) and still equals caching off; its own
    # blocks are then cached and the third turn hits them.
    kw = dict(async_scheduling=False, max_model_len=40, num_gpu_blocks_override=5)
    on = make_llm(device, "bamba", True, **kw)
    core = on.llm_engine.engine_core
    kv, index = core.scheduler.kv, core.prefix.index
    other = [(7 * i) % 97 for i in range(25)]
    out1 = run(on, FIRST, 5)
    run(on, other, 2)
    assert kv.evictions == 1
    second = FIRST + out1[0] + [12, 60, 2]
    assert core.prefix.lookup(second)[0] == 0 and FIRST + out1[0][:-1] == second[:11]
    out2 = run(on, second, 4, cached=0)
    assert index.hits == 0 and kv.evictions > 1
    third = second + out2[0] + [4]
    out3 = run(on, third, 2, cached=len(second) + 3)
    kv.check()
    off = reference("bamba")
    same(out2, run(off, second, 4))
    same(out3, run(off, third, 2))


def test_random_multi_turn_traffic_keeps_the_block_invariants(monkeypatch):
    """Random conversations (each new prompt extends a finished one's tokens, or not),
    aborts in flight, a KV budget that forces evictions: after every step the shared
    blocks' counts, the LRU and the reservations are consistent, hits, tail copies and
    evictions all happen, and at the end no block is held. The bookkeeping is what is
    tested, so the kernels run as their PyTorch references (TRITON_INTERPRET=0)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    llm = make_llm(torch.device("cpu"), "bamba", True, max_num_seqs=3,
                   max_num_batched_tokens=9, num_gpu_blocks_override=20,
                   num_checkpoint_lines=6)  # fmt: skip
    engine, rng = llm.llm_engine, random.Random(0)
    core = engine.engine_core
    kv, sched = core.scheduler.kv, core.scheduler
    steps = recording(llm)
    done: list[list[int]] = []
    next_id = 0
    while next_id < 120 or engine.has_unfinished_requests():
        if next_id < 120 and rng.random() < 0.5:
            base = rng.choice(done[-4:]) if done and rng.random() < 0.8 else []
            base = base if len(base) <= 36 else []  # room for the new tokens and the output
            prompt = base + [rng.randrange(128) for _ in range(rng.randint(1, 6))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 6),
                                    ignore_eos=True)  # fmt: skip
            engine.add_request(f"r{next_id}", prompt, params)
            next_id += 1
        if sched.running and rng.random() < 0.03:
            engine.abort_request(rng.choice(sched.running).request_id)
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason == "length":
                done.append(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
        kv.check()
    # Seen: 1142 tokens restored, 170 blocks evicted, 68 tail copies.
    assert core.prefix.index.hits > 500 and kv.evictions > 50
    assert sum(len(s.kv_copies) for s in steps) > 20
    assert kv.num_reserved == 0 and all(kv.refs_of(b) == 0 for b in range(kv.num_blocks))

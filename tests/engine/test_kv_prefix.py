"""PrefixKVCacheManager and HybridPrefixCache without a model: reference counts, the LRU of
cached blocks and its eviction order, reservations with shared blocks (a randomised
invariant test), refused calls, and the tail block's copy-on-write restore."""

from __future__ import annotations

import copy
import random

import pytest

from vllm.engine.kv_cache_manager import NoFreeBlocksError
from vllm.engine.kv_prefix import HybridPrefixCache, PrefixKVCacheManager
from vllm.engine.prefix_cache import hash_blocks

BS = 4


def finished(kv: PrefixKVCacheManager, seq, tokens) -> None:
    """A sequence that computed ``tokens`` in blocks of its own, registered and freed."""
    kv.reserve(seq, len(tokens))
    kv.allocate(seq, len(tokens))
    kv.register(seq, tokens)
    kv.free(seq)
    kv.check()


def state(kv: PrefixKVCacheManager):
    return copy.deepcopy(
        (kv._free, kv._tables, kv._promised, kv._reserved, kv._refs, kv._hash_of, list(kv._lru))
    )


def test_shared_blocks_are_counted_by_reference():
    kv = PrefixKVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # two full blocks and a tail of 2
    finished(kv, "a", tokens)
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == 8
    hashes = hash_blocks(tokens, BS)
    full, tail = kv.cached_blocks(tokens, 10, hashes)
    assert full == [0, 1] and tail == 2
    assert kv.cached_blocks(tokens, 8, hashes) == ([0, 1], None)
    assert kv.cached_blocks(tokens, 9, hashes) is None  # no tail of one token was kept
    for seq in ("b", "c"):
        kv.reserve(seq, 12)
        kv.attach(seq, full)
        kv.check()
    assert [kv.refs_of(b) for b in full] == [2, 2]
    # Worst cases of 3 blocks each, 2 of them shared: one promised block per sequence.
    assert kv.num_reserved == 2 and kv.num_available_blocks == 8 - 2 - 2
    kv.free("b")
    assert [kv.refs_of(b) for b in full] == [1, 1]
    kv.free("c")
    kv.check()
    assert kv.num_free_blocks == 8 and kv.num_reserved == 0 and kv.num_cached_blocks == 3


def test_lru_blocks_are_taken_only_when_the_free_list_is_empty_oldest_first():
    kv = PrefixKVCacheManager(num_blocks=6, block_size=BS)
    finished(kv, "a", list(range(8)))  # blocks 0, 1 cached
    finished(kv, "b", list(range(100, 108)))  # blocks 2, 3 cached
    assert kv.num_cached_blocks == 4 and kv.evictions == 0
    kv.reserve("c", 8)
    assert kv.allocate("c", 8) == [4, 5]  # the free blocks first
    assert kv.evictions == 0
    kv.reserve("d", 12)
    # "a" was freed first, its last block first: 1, 0, then 3, 2.
    assert kv.allocate("d", 12) == [1, 0, 3]
    assert kv.evictions == 3 and kv.num_cached_blocks == 1
    assert kv.block_of(hash_blocks(list(range(100, 108)), BS)[0]) == 2
    assert kv.cached_blocks(list(range(8)), 4, hash_blocks(list(range(8)), BS)) is None
    kv.check()


def test_a_shared_block_is_never_taken():
    kv = PrefixKVCacheManager(num_blocks=4, block_size=BS)
    finished(kv, "a", list(range(8)))
    kv.reserve("b", 4)
    kv.attach("b", [0])  # block 1 stays in the LRU, block 0 is held
    kv.reserve("c", 12)
    assert kv.allocate("c", 12) == [2, 3, 1]  # the held block is never taken
    kv.check()


def test_refused_calls_change_nothing():
    kv = PrefixKVCacheManager(num_blocks=4, block_size=BS)
    finished(kv, "a", list(range(6)))
    kv.reserve("b", 16)
    before = state(kv)
    with pytest.raises(NoFreeBlocksError):
        kv.reserve("c", 4)
    with pytest.raises(ValueError, match="no reservation"):
        kv.attach("c", [0])
    with pytest.raises(ValueError, match="distinct cached blocks"):
        kv.attach("b", [0, 0])
    with pytest.raises(ValueError, match="distinct cached blocks"):
        kv.attach("b", [3])  # not cached
    assert state(kv) == before
    kv.attach("b", [0])
    before = state(kv)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.attach("b", [0])
    with pytest.raises(NoFreeBlocksError):
        kv.allocate("b", 20)
    assert state(kv) == before
    kv.check()


def test_random_operations_never_over_commit():
    """3,000 random reserve/attach/allocate/register/free calls over few blocks, prompts
    cut from four token lists (so prefixes repeat): the invariants hold after every call,
    and a sequence allocating within its reservation always gets its blocks."""
    rng = random.Random(0)
    kv = PrefixKVCacheManager(num_blocks=12, block_size=BS)
    live: dict[int, tuple[list[int], int]] = {}  # seq -> (tokens, worst case)
    shared = refused = 0
    bases = [[rng.randrange(4) for _ in range(14)] for _ in range(4)]  # prefixes repeat
    for step in range(3000):
        op = rng.random()
        if op < 0.3:
            tokens = rng.choice(bases)[: rng.randint(1, 14)]
            worst = len(tokens) + rng.randint(0, 6)
            try:
                kv.reserve(step, worst)
            except NoFreeBlocksError:
                refused += 1
                kv.check()
                continue
            n = len(tokens) - len(tokens) % BS
            hit = kv.cached_blocks(tokens, n, hash_blocks(tokens, BS))
            if hit is not None and hit[0]:
                kv.attach(step, hit[0])
                shared += 1
            live[step] = (tokens, worst)
        elif op < 0.7 and live:
            seq = rng.choice(list(live))
            tokens, worst = live[seq]
            have = len(kv.block_table(seq)) * BS
            kv.allocate(seq, min(worst, have + rng.randint(1, 6)))  # never refused
        elif live:
            seq = rng.choice(list(live))
            tokens, _ = live.pop(seq)
            kv.allocate(seq, len(tokens))
            kv.register(seq, tokens)
            kv.free(seq)
        kv.check()
    assert shared > 200 and refused > 100 and kv.evictions > 500


def test_hybrid_restore_shares_full_blocks_and_copies_the_tail():
    kv = PrefixKVCacheManager(num_blocks=16, block_size=BS)
    cache = HybridPrefixCache(lines=[3, 4], block_size=2, kv=kv)
    first = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    kv.reserve("a", 12)
    table = list(kv.allocate("a", 10))
    assert cache.checkpoint(first, 10, slot=1, seq_id="a")
    kv.free("a")
    assert cache.take_copies() == [(1, 3)]
    # 10 tokens: two full blocks of 4 and a tail of 2.
    prompt = first + [1, 2]
    kv.reserve("b", 14)
    assert cache.restore(prompt, slot=2, seq_id="b") == 10
    got = kv.block_table("b")
    assert got[:2] == table[:2] and got[2] != table[2]
    assert cache.take_kv_copies() == [(table[2], got[2])]
    assert cache.take_copies() == [(3, 2)]
    kv.check()
    # A prompt that diverges inside the last full block shares nothing: no KV, no hit.
    other = first[:7] + [99, 9, 10, 11]
    kv.reserve("c", 12)
    assert cache.restore(other, slot=1, seq_id="c") == 0
    assert kv.block_table("c") == [] and cache.take_kv_copies() == []


def test_hybrid_lookup_falls_back_when_a_kv_block_was_evicted():
    kv = PrefixKVCacheManager(num_blocks=4, block_size=BS)
    cache = HybridPrefixCache(lines=[3], block_size=2, kv=kv)
    first = [5, 6, 7, 8, 9, 10]
    kv.reserve("a", 6)
    kv.allocate("a", 6)
    cache.checkpoint(first, 6, slot=1, seq_id="a")
    kv.free("a")
    cache.take_copies()
    assert cache.lookup(first + [1])[0] == 6
    kv.reserve("x", 16)
    kv.allocate("x", 16)  # takes every block: the cached ones are evicted
    assert cache.lookup(first + [1]) == (0, None)
    kv.free("x")
    cache.drop_all()
    kv.check()


def test_a_running_sequences_prefix_can_be_named_and_shared():
    # Prompt-boundary checkpoints name the blocks of a sequence still running: its full
    # blocks up to the boundary are shared by reference, its tail only ever copied.
    kv = PrefixKVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(20, 34))
    kv.reserve("a", 16)
    table = list(kv.allocate("a", 14))
    assert kv.register("a", tokens[:6]) == 2  # block 0 and the tail of 2 in block 1
    assert kv.cached_blocks(tokens, 6, hash_blocks(tokens, BS)) == ([table[0]], table[1])
    kv.reserve("b", 8)
    kv.attach("b", [table[0]])
    assert kv.refs_of(table[0]) == 2
    # At its end the owner names its longer tail (7 tokens) on the same block too.
    assert kv.register("a", tokens[:7]) == 1
    assert kv.cached_blocks(tokens, 7, hash_blocks(tokens, BS)) == ([table[0]], table[1])
    assert kv.cached_blocks(tokens, 6, hash_blocks(tokens, BS)) == ([table[0]], table[1])
    kv.free("a")
    kv.check()
    assert kv.refs_of(table[0]) == 1 and kv.num_cached_blocks == 2
    kv.free("b")
    kv.reserve("c", 32)
    kv.allocate("c", 32)  # every block: both names of the tail block go with it
    assert kv.cached_blocks(tokens, 6, hash_blocks(tokens, BS)) is None
    assert kv.cached_blocks(tokens, 7, hash_blocks(tokens, BS)) is None
    kv.check()

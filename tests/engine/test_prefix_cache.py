"""Prefix caching, engine side: the block hash chain and the checkpoint index (no model)."""

from __future__ import annotations

import random

import pytest

from vllm.engine.prefix_cache import (
    ROOT_HASH,
    CheckpointIndex,
    StatePrefixCache,
    boundary_hash,
    hash_block,
    hash_blocks,
    max_hit_blocks,
)
from vllm.engine.prefix_policy import PromptCheckpoints

# --- hash chain -------------------------------------------------------------------------


def test_hash_chain_names_the_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the partial last block has no hash
    # Same second block after a different first block: a different hash.
    b = hash_blocks([9, 9, 3, 4], 2)
    assert b[1] != a[1] and b[0] != a[0]
    # A prompt that extends another shares its full blocks' hashes.
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)[:3] == a
    # Extra keys (a LoRA, an image) separate equal tokens.
    assert hash_blocks([1, 2, 3, 4], 2, extra_keys=("lora-1",)) != a[:2]
    # Deterministic and 32 bytes (sha256, equal across processes).
    assert a == hash_blocks([1, 2, 3, 4, 5, 6, 7], 2) and all(len(h) == 32 for h in a)
    assert a[0] == hash_block(ROOT_HASH, [1, 2])


def test_hash_chain_extends_incrementally():
    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(53)]
    full = hash_blocks(tokens, 8)
    part = hash_blocks(tokens[:20], 8)  # 2 blocks
    rest = hash_blocks(tokens, 8, parent=part[-1], start_block=len(part))
    assert part + rest == full and len(full) == 6


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: hash_blocks([1, 2], 0), "block_size"),
        (lambda: hash_blocks([1, 2], 1, start_block=-1), "start_block"),
        (lambda: hash_block(b"short", [1]), "parent"),
        (lambda: hash_block(ROOT_HASH, [1, -2]), "tokens"),
        (lambda: max_hit_blocks(0, 4), "num_prompt_tokens"),
        (lambda: CheckpointIndex([]), "lines"),
        (lambda: CheckpointIndex([0, 1]), "lines"),
        (lambda: CheckpointIndex([3, 3]), "distinct"),
    ],
)
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "n,block,expect", [(1, 4, 0), (3, 4, 0), (4, 4, 0), (5, 4, 1), (8, 4, 1), (9, 4, 2)]
)
def test_a_hit_leaves_at_least_one_prompt_token(n, block, expect):
    # The prompt lengths of the sweep: 1, block-1, block, block+1, 2*block, 2*block+1.
    assert max_hit_blocks(n, block) == expect


def test_boundary_hash_only_on_the_grid():
    hashes = hash_blocks(list(range(10)), 4)  # 2 full blocks
    assert boundary_hash(hashes, 0, 4) is None
    assert boundary_hash(hashes, 3, 4) is None
    assert boundary_hash(hashes, 4, 4) == hashes[0]
    assert boundary_hash(hashes, 8, 4) == hashes[1]
    assert boundary_hash(hashes, 12, 4) is None  # no hash yet for the third block


# --- checkpoint index -------------------------------------------------------------------


def test_pending_checkpoint_does_not_match_until_committed():
    idx = CheckpointIndex([5, 6])
    h = hash_blocks(list(range(8)), 4)
    line = idx.reserve(h[1])
    assert line == 5 and idx.match(h) == (0, None) and h[1] not in idx
    # A second cold request with the same prefix finds the pending entry: nothing to write.
    assert idx.reserve(h[1]) is None
    with pytest.raises(ValueError, match="pending"):
        idx.acquire(h[1])
    idx.commit(h[1])
    assert idx.match(h) == (2, 5)  # the longest prefix; block 0 needs no checkpoint
    assert idx.match(h[:1]) == (0, None)
    idx.check()


def three_committed() -> tuple[CheckpointIndex, list[bytes]]:
    """An index of three lines, all committed (oldest first), and six hashes."""
    idx = CheckpointIndex([1, 2, 3])
    hs = [hash_block(ROOT_HASH, [i]) for i in range(6)]
    for h in hs[:3]:
        idx.reserve(h)
        idx.commit(h)
    return idx, hs


def test_lru_eviction_skips_pinned_and_pending():
    idx, hs = three_committed()
    idx.acquire(hs[0])  # pinned by a restoring sequence
    assert idx.reserve(hs[1]) is None  # refresh: hs[1] becomes the youngest
    line = idx.reserve(hs[3])  # evicts hs[2], the oldest unpinned
    assert line == 3 and hs[2] not in idx and idx.evictions == 1
    line = idx.reserve(hs[4])  # evicts hs[1]; hs[0] stays pinned, hs[3] is pending
    assert line == 2 and hs[1] not in idx
    assert idx.reserve(hs[5]) is None  # everything pinned or pending: refused, unchanged
    assert len(idx) == 3 and idx.num_evictable == 0
    idx.release(hs[0])
    assert idx.reserve(hs[5]) == 1 and hs[0] not in idx
    idx.check()


def test_lookup_reuses_the_callers_block_hashes(monkeypatch):
    """Admission hashes a prompt once (core._restore) for the lookup and the policy: a
    lookup given the prompt's hashes computes no block hash, and finds the same."""
    import vllm.engine.block_hash as block_hash

    cache = StatePrefixCache([1, 2], block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: three full blocks, a lookup reads 12
    assert cache.checkpoint(prompt, 8, slot=5)
    hashes = hash_blocks(prompt, 4)
    calls, real = [], block_hash.hash_block
    monkeypatch.setattr(block_hash, "hash_block", lambda *a: calls.append(a) or real(*a))
    assert cache.lookup(prompt, hashes) == (8, hashes[1]) and not calls
    assert cache.lookup(prompt) == (8, hashes[1]) and len(calls) == 3


def test_demote_makes_an_entry_the_next_victim_and_leaves_pins_alone():
    idx, hs = three_committed()
    idx.demote(hs[2])  # the youngest becomes the oldest
    assert idx.reserve(hs[3]) == 3 and hs[2] not in idx and hs[0] in idx
    idx.acquire(hs[0])
    idx.demote(hs[0])  # pinned: not in the LRU, nothing to do
    idx.demote(hs[3])  # pending: nothing to do
    idx.demote(hs[5])  # unknown: nothing to do
    assert idx.reserve(hs[4]) == 2 and hs[1] not in idx and hs[0] in idx
    idx.check()


def test_discard_and_double_release_and_clear():
    idx = CheckpointIndex([7, 8])
    a, b = hash_block(ROOT_HASH, [1]), hash_block(ROOT_HASH, [2])
    assert idx.reserve(a) == 7
    idx.discard(a)  # its request was aborted before the copy
    assert a not in idx and idx.num_free_lines == 2
    idx.reserve(a)
    idx.commit(a)
    with pytest.raises(ValueError, match="committed"):
        idx.discard(a)
    with pytest.raises(ValueError, match="double release"):
        idx.release(a)
    with pytest.raises(KeyError, match="acquire"):
        idx.acquire(b)
    idx.reserve(b)
    idx.commit(b)
    idx.acquire(b)
    idx.clear()  # drops a, keeps the pinned b
    assert a not in idx and b in idx and idx.num_free_lines == 1
    idx.check()


def test_counters_are_tokens():
    idx = CheckpointIndex([1])
    idx.record(10, 8)
    idx.record(5, 0)
    assert (idx.queries, idx.hits) == (15, 8)
    with pytest.raises(ValueError, match="num_hit_tokens"):
        idx.record(3, 4)


def test_random_operations_keep_the_invariants():
    rng = random.Random(31)
    idx = CheckpointIndex(range(1, 6))
    keys = [hash_block(ROOT_HASH, [i]) for i in range(12)]
    pins: list[bytes] = []
    pending: list[bytes] = []
    for _ in range(3000):
        op = rng.random()
        k = rng.choice(keys)
        if op < 0.35:
            if idx.reserve(k) is not None:
                pending.append(k)
        elif op < 0.6 and pending:
            p = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.8:
                idx.commit(p)
            else:
                idx.discard(p)
        elif op < 0.8 and k in idx:
            assert idx.acquire(k) == idx.line_of(k)
            pins.append(k)
        elif pins:
            idx.release(pins.pop(rng.randrange(len(pins))))
        idx.check()
        # A pinned entry is never evicted or rewritten.
        assert all(p in idx and idx.refs_of(p) > 0 for p in pins)
    assert idx.evictions > 0


# --- prompt-checkpoint targets (vllm/engine/prefix_policy.py) ---------------------------


def test_prompt_targets_by_mode_and_the_seen_bound():
    prompt = list(range(1, 15))  # 14 tokens: boundaries 4, 8, 12 short of the end
    hashes = hash_blocks(prompt, 4)
    prefix = StatePrefixCache(range(3, 9), 4)
    every = PromptCheckpoints(prefix, "all")
    assert every.targets(14, hashes, 0) == [4, 8, 12]
    assert every.targets(14, hashes, 5) == [8, 12]  # past the restored prefix
    assert every.targets(12, hashes[:3], 0) == [4, 8]  # short of the prompt's end
    assert prefix.write(hashes[1], 1)  # cached already: skipped
    assert every.targets(14, hashes, 0) == [4, 12]

    align = PromptCheckpoints(StatePrefixCache(range(3, 9), 4), "align", seen_bound=3)
    assert align.targets(14, hashes, 0) == []  # nothing seen yet
    align._remember(hash_blocks(prompt[:10] + [99, 98], 4))  # shares blocks 1 and 2
    assert align.targets(14, hashes, 0) == [8]  # the deepest shared boundary only
    assert align.targets(14, hashes, 8) == []  # restored up to it
    align._remember(hash_blocks([50] * 12, 4))  # three new hashes push the old ones out
    assert align.targets(14, hashes, 0) == []
    off = PromptCheckpoints(StatePrefixCache(range(3, 9), 4), "align", shared_prefix=False)
    off._remember(hashes)
    assert off.targets(14, hashes, 0) == []
    for mode in ("none", "bogus"):
        with pytest.raises(ValueError, match="mamba_cache_mode"):
            PromptCheckpoints(prefix, mode)

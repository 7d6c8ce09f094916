"""KVCacheManager: growth, frees, reservations, exhaustion, and no leaks under random load."""

from __future__ import annotations

import random

import pytest

from vllm.engine.kv_cache_manager import KVCacheManager, NoFreeBlocksError


def _snapshot(m: KVCacheManager):
    return (
        list(m._free),
        {k: list(v) for k, v in m._tables.items()},
        dict(m._promised),
        m.num_reserved,
    )


def _check_invariants(m: KVCacheManager, tokens: dict) -> None:
    held = [b for t in m._tables.values() for b in t]
    # Every block is either free or held by exactly one sequence.
    assert sorted(held + m._free) == list(range(m.num_blocks))
    for sid, n in tokens.items():
        assert len(m.block_table(sid)) == m.blocks_needed(n)
    expected_reserved = sum(
        max(0, p - len(m._tables.get(sid, ()))) for sid, p in m._promised.items()
    )
    assert m.num_reserved == expected_reserved
    assert 0 <= m.num_reserved <= m.num_free_blocks
    assert m.num_available_blocks == m.num_free_blocks - m.num_reserved


def test_growth_and_free():
    m = KVCacheManager(num_blocks=10, block_size=4)
    assert [m.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert m.allocate("a", 5) == [0, 1]
    assert m.allocate("a", 7) == [0, 1]  # still fits in 2 blocks
    assert m.allocate("a", 9) == [0, 1, 2]
    assert m.allocate("a", 3) == [0, 1, 2]  # fewer tokens: unchanged
    assert m.allocate("b", 1) == [3]
    assert m.num_free_blocks == 6
    assert m.block_table("a") == [0, 1, 2] and m.block_table("nobody") == []
    assert "a" in m and "nobody" not in m
    m.free("a")
    assert m.num_free_blocks == 9 and m.block_table("a") == [] and "a" not in m
    m.free("a")  # unknown now: no-op
    m.free(12345)
    assert m.num_free_blocks == 9
    assert m.allocate("c", 0) == [] and "c" in m


def test_exhaustion_leaves_state_unchanged():
    m = KVCacheManager(num_blocks=4, block_size=2)
    m.allocate("a", 5)  # 3 blocks
    before = _snapshot(m)
    assert not m.can_allocate("b", 3)
    with pytest.raises(NoFreeBlocksError, match="needs 2 more blocks of 2 tokens"):
        m.allocate("b", 3)
    assert _snapshot(m) == before and "b" not in m
    with pytest.raises(NoFreeBlocksError):
        m.allocate("a", 9)  # growing past the cache
    assert _snapshot(m) == before
    assert m.can_allocate("b", 2) and m.allocate("b", 2) == [3]
    assert m.num_free_blocks == 0


def test_reservations_protect_admitted_sequences():
    m = KVCacheManager(num_blocks=10, block_size=4)
    m.reserve("a", 20)  # worst case 5 blocks, none allocated
    assert (m.num_free_blocks, m.num_reserved, m.num_available_blocks) == (10, 5, 5)
    assert m.can_reserve("b", 20) and not m.can_reserve("b", 21)
    m.reserve("b", 20)
    assert m.num_available_blocks == 0
    assert not m.can_allocate("c", 1)
    with pytest.raises(NoFreeBlocksError, match="0 of them not promised"):
        m.allocate("c", 1)
    with pytest.raises(NoFreeBlocksError, match="needs 1 more blocks"):
        m.reserve("c", 1)
    # Admitted sequences grow inside their promises, step by step.
    for n in range(1, 21):
        m.allocate("a", n)
        m.allocate("b", n)
    assert m.num_free_blocks == 0 and m.num_reserved == 0
    # Past its promise a sequence competes for unpromised blocks like anyone (none left).
    with pytest.raises(NoFreeBlocksError):
        m.allocate("a", 21)
    m.free("b")
    assert m.num_available_blocks == 5 and m.allocate("a", 21) == m.block_table("a")
    assert len(m.block_table("a")) == 6


def test_reserve_replaces_and_unreserve():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("a", 6)  # 2 blocks
    m.reserve("a", 16)  # 4 in total: 2 more promised
    assert m.num_reserved == 2
    m.reserve("a", 10)  # shrink: 3 in total
    assert m.num_reserved == 1
    m.reserve("a", 4)  # below what it holds: nothing promised
    assert m.num_reserved == 0 and len(m.block_table("a")) == 2
    m.reserve("a", 32)
    assert m.num_reserved == 6 and m.num_available_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        m.reserve("a", 33)
    assert m.num_reserved == 6
    m.unreserve("a")
    assert m.num_reserved == 0 and len(m.block_table("a")) == 2
    m.unreserve("a")  # no promise left: no-op
    m.unreserve("nobody")
    m.reserve("b", 8)
    m.free("b")  # a sequence with a promise and no blocks
    assert m.num_reserved == 0 and m.num_free_blocks == 6


def test_random_load_never_leaks():
    """Thousands of requests arriving, reserving their worst case, growing by random
    chunks, finishing early or being aborted; after each operation every block is
    accounted for exactly once, and at the end all are free."""
    rng = random.Random(13)
    m = KVCacheManager(num_blocks=97, block_size=16)
    tokens: dict[int, int] = {}
    limits: dict[int, int] = {}
    next_id, refused = 0, 0
    for _ in range(6000):
        op = rng.random()
        if op < 0.3:  # a new request: admit it if its worst case fits
            prompt, max_new = rng.randint(1, 300), rng.randint(1, 200)
            ok = m.can_reserve(next_id, prompt + max_new)
            if ok:
                m.reserve(next_id, prompt + max_new)
                tokens[next_id], limits[next_id] = 0, prompt + max_new
            else:
                before = _snapshot(m)
                with pytest.raises(NoFreeBlocksError):
                    m.reserve(next_id, prompt + max_new)
                assert _snapshot(m) == before
                refused += 1
            next_id += 1
        elif op < 0.8 and tokens:  # a step of a running request (inside its promise)
            sid = rng.choice(list(tokens))
            n = min(limits[sid], tokens[sid] + rng.choice([1, 1, 1, 17, 64]))
            assert m.can_allocate(sid, n)
            m.allocate(sid, n)
            tokens[sid] = n
        elif op < 0.95 and tokens:  # finished or aborted
            sid = rng.choice(list(tokens))
            m.free(sid)
            del tokens[sid], limits[sid]
        else:  # an unreserved sequence tries to grab blocks (may be refused)
            n = rng.randint(1, 400)
            before = _snapshot(m)
            if m.can_allocate("greedy", n):
                m.allocate("greedy", n)  # fewer tokens than it holds keep its table
                n = max(n, tokens.get("greedy", 0))
                tokens["greedy"], limits["greedy"] = n, n
            else:
                with pytest.raises(NoFreeBlocksError):
                    m.allocate("greedy", n)
                assert _snapshot(m) == before
        _check_invariants(m, tokens)
    assert refused > 0 and next_id > 1000  # the load did hit the limit
    for sid in list(tokens):
        m.free(sid)
    assert m.num_free_blocks == 97 and m.num_reserved == 0 and not m._tables


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: KVCacheManager(0, 16), "num_blocks must be an int >= 1"),
        (lambda: KVCacheManager(4, 0), "block_size must be an int >= 1"),
        (lambda: KVCacheManager(4, 2.5), "block_size must be an int >= 1"),
        (lambda: KVCacheManager(4, 4).allocate("a", -1), "num_tokens must be an int >= 0"),
        (lambda: KVCacheManager(4, 4).reserve("a", 1.5), "num_tokens must be an int >= 0"),
        (lambda: KVCacheManager(4, 4).blocks_needed(True), "num_tokens must be an int >= 0"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()

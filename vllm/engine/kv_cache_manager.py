"""KVCacheManager: hands out the paged KV cache's blocks, a block table per sequence.

A sequence's table grows as its tokens do (``allocate(seq_id, total_tokens)``): blocks
are taken only when a step's tokens need them, never for ``max_model_len`` up front. All
attention layers share the block ids (each layer has its own cache tensor, indexed alike).

Admission without over-commit: ``reserve(seq_id, total_tokens)`` promises a sequence
enough blocks for its worst case (prompt + max_tokens) without taking them. Promised
blocks stay free, but no other sequence can allocate them: ``num_available_blocks`` (free
minus promised-and-not-yet-allocated) is what is left for everyone else, and
``can_reserve`` is the admission test. A sequence allocating within its reservation
always succeeds. ``unreserve`` drops a promise, ``free`` drops the promise and returns
the blocks.

Invariant: promised-not-allocated blocks (``num_reserved``) <= ``num_free_blocks``.
Every operation is O(1) per block it moves; a refused call changes nothing.

Where blocks come from and go back to is three hooks (``_num_takeable``, ``_take``,
``_give_back``): here a free list; the prefix cache's manager (``kv_prefix.py``) adds
shared blocks with reference counts and an LRU of cached ones.
"""

from __future__ import annotations

from collections.abc import Hashable


class NoFreeBlocksError(RuntimeError):
    """Not enough free (unpromised) blocks; the manager's state is unchanged."""


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = _check_int("num_blocks", num_blocks, 1)
        self.block_size = _check_int("block_size", block_size, 1)
        # Popped from the end: block 0 first, so a quiet engine touches few blocks.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._promised: dict[Hashable, int] = {}  # blocks promised per sequence (total)
        self._reserved = 0  # sum over sequences of promised blocks not yet allocated

    # --- queries --------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (promised ones included)."""
        return self._num_takeable()

    @property
    def num_reserved(self) -> int:
        """Blocks promised by reservations and not allocated yet."""
        return self._reserved

    @property
    def num_available_blocks(self) -> int:
        """Free blocks no reservation claims: what a sequence without one can take."""
        return self._num_takeable() - self._reserved

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        _check_int("num_tokens", num_tokens, 0)
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's physical blocks in order ([] when it has none). The manager's own
        list, valid until its next allocate/free: read it, do not modify it."""
        return self._tables.get(seq_id, [])

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables or seq_id in self._promised

    def _own_reserved(self, seq_id: Hashable, num_allocated: int) -> int:
        return max(0, self._promised.get(seq_id, 0) - num_allocated)

    def _extra(self, seq_id: Hashable, num_tokens: int) -> tuple[int, int]:
        """(blocks the sequence lacks for num_tokens, blocks it may take for them)."""
        have = len(self._tables.get(seq_id, ()))
        extra = self.blocks_needed(num_tokens) - have
        usable = self._num_takeable() - (self._reserved - self._own_reserved(seq_id, have))
        return extra, usable

    def can_allocate(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Would ``allocate(seq_id, num_tokens)`` succeed (its own reservation counts)?"""
        extra, usable = self._extra(seq_id, num_tokens)
        return extra <= usable

    def can_reserve(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Would ``reserve(seq_id, num_tokens)`` succeed? The admission test."""
        return self._reserve_delta(seq_id, num_tokens) <= self.num_available_blocks

    # --- changes --------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int]:
        """Grow the sequence's table to cover ``num_tokens`` tokens in total and return
        it (a smaller count keeps the table as it is). Raises NoFreeBlocksError, changing
        nothing, when the free blocks not promised to other sequences are too few."""
        extra, usable = self._extra(seq_id, num_tokens)
        if extra > usable:
            raise NoFreeBlocksError(
                f"sequence {seq_id!r} needs {extra} more blocks of {self.block_size} tokens for "
                f"{num_tokens} tokens; {self._num_takeable()} are free and {usable} of them not "
                "promised to other sequences"
            )
        table = self._tables.setdefault(seq_id, [])
        if extra <= 0:
            return table
        before = self._own_reserved(seq_id, len(table))
        for _ in range(extra):
            table.append(self._take())
        self._reserved -= before - self._own_reserved(seq_id, len(table))
        return table

    def _reserve_delta(self, seq_id: Hashable, num_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        new = max(0, self.blocks_needed(num_tokens) - have)
        return new - self._own_reserved(seq_id, have)

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Promise the sequence blocks for ``num_tokens`` tokens in total (its worst case),
        replacing an earlier promise; nothing is allocated. Raises NoFreeBlocksError,
        changing nothing, when the unpromised free blocks do not cover it."""
        delta = self._reserve_delta(seq_id, num_tokens)
        if delta > self.num_available_blocks:
            raise NoFreeBlocksError(
                f"reserving {num_tokens} tokens for sequence {seq_id!r} needs {delta} more "
                f"blocks; {self.num_available_blocks} free blocks are not promised"
            )
        self._promised[seq_id] = self.blocks_needed(num_tokens)
        self._reserved += delta

    def unreserve(self, seq_id: Hashable) -> None:
        """Drop the sequence's promise (its allocated blocks stay); unknown id: no-op."""
        if seq_id not in self._promised:
            return
        self._reserved -= self._own_reserved(seq_id, len(self._tables.get(seq_id, ())))
        del self._promised[seq_id]

    def free(self, seq_id: Hashable) -> None:
        """Return all the sequence's blocks and drop its promise; unknown id: no-op."""
        self.unreserve(seq_id)
        table = self._tables.pop(seq_id, None)
        if table:
            self._give_back(table)

    # --- where blocks come from and go back to (hooks) ------------------------------

    def _num_takeable(self) -> int:
        """Blocks no sequence holds: what ``_take`` can hand out."""
        return len(self._free)

    def _take(self) -> int:
        """One block for a sequence's table (the caller checked ``_num_takeable``)."""
        return self._free.pop()

    def _give_back(self, table: list[int]) -> None:
        """A freed sequence's blocks (its first block is handed out first again)."""
        self._free.extend(reversed(table))

"""Prefix caching for hybrids: attention KV blocks shared between requests, beside the Mamba
checkpoints (``docs/prefix_caching.md``, "Attention KV blocks").

- ``PrefixKVCacheManager``: the ``KVCacheManager`` with cached blocks. A full block of
  ``block_size`` tokens is named by the chain hash of its prefix (``hash_blocks`` with the
  attention block size); a request's partly filled last block, kept when it finishes, by
  its *tail* hash (the last full block's hash, the tail's tokens), as the Mamba tail is.
  Each block has a reference count (the tables holding it); a cached block whose count
  falls to 0 joins an LRU: free, but reusable until ``_take`` needs it, which it does only
  when the free list is empty (the oldest first; a freed table gives its last block
  first, so a prefix's end goes before its start). ``num_free_blocks`` and
  ``num_available_blocks`` count the LRU's blocks as free.
- Sharing: ``attach`` starts a sequence's table with cached full blocks (count + 1 each);
  its reservation, made first for its worst case, shrinks by as many blocks, so shared
  blocks are counted once and an attach never over-commits (it frees at least as many
  promised blocks as it takes from the LRU). A cached tail is never shared: the sequence
  appends into that block, so it gets a fresh block and a queued KV copy (cached tail ->
  fresh; copy-on-write), run by the worker before the step's forward.
- ``HybridPrefixCache``: ``StatePrefixCache`` that restores a prefix only when its Mamba
  checkpoint and every attention block up to it (full blocks, and the tail block when the
  length is off the attention grid) are cached: the longest such prefix; at the end of a
  request it registers the sequence's blocks beside the Mamba checkpoint.

Copies run in queue order before the forward that follows, so a cached tail taken by a
later ``_take`` of the same step (evicted and handed to another sequence) is read before
anything writes it: no pin is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence

from vllm.engine.kv_cache_manager import KVCacheManager
from vllm.engine.prefix_cache import ROOT_HASH, StatePrefixCache, hash_block, hash_blocks


class PrefixKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, set[bytes]] = {}  # cached block -> its names (hashes)
        self._block_of: dict[bytes, int] = {}  # hash -> cached block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, refs == 0; oldest first
        self.evictions = 0

    # --- hooks of KVCacheManager ----------------------------------------------------

    def _num_takeable(self) -> int:
        return len(self._free) + len(self._lru)

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            for h in self._hash_of.pop(block):
                del self._block_of[h]
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _give_back(self, table: list[int]) -> None:
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    # --- queries --------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash (held or in the LRU)."""
        return len(self._hash_of)

    def refs_of(self, block: int) -> int:
        return self._refs[block]

    def block_of(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def tail_hash(self, tokens: Sequence[int], length: int, hashes: Sequence[bytes]) -> bytes:
        """The hash of ``tokens[:length]``'s partial last block (``length`` off the grid),
        under its parent, ``hashes[length // block_size - 1]`` or the root."""
        full = length // self.block_size
        parent = hashes[full - 1] if full else ROOT_HASH
        return hash_block(parent, tokens[full * self.block_size : length])

    def cached_blocks(
        self, tokens: Sequence[int], length: int, hashes: Sequence[bytes]
    ) -> tuple[list[int], int | None] | None:
        """The cached blocks that hold the KV of ``tokens[:length]``: (its full blocks, its
        tail block or None on the grid), or None when one is missing. ``hashes``: the full
        blocks' chain hashes of ``tokens`` (at least ``length // block_size``). Pure."""
        full, tail = divmod(length, self.block_size)
        if full > len(hashes):
            raise ValueError(f"hashes cover {len(hashes)} blocks, length {length} needs {full}")
        blocks = []
        for h in hashes[:full]:
            block = self._block_of.get(h)
            if block is None:
                return None
            blocks.append(block)
        if not tail:
            return blocks, None
        block = self._block_of.get(self.tail_hash(tokens, length, hashes))
        return None if block is None else (blocks, block)

    # --- sharing and registering ----------------------------------------------------

    def attach(self, seq_id: Hashable, blocks: Iterable[int]) -> list[int]:
        """Start the sequence's (empty) table with these cached blocks, shared; its
        reservation must cover them and shrinks by as many. Raises ValueError, changing
        nothing, otherwise."""
        blocks = list(blocks)
        if self._tables.get(seq_id):
            raise ValueError(f"attach: sequence {seq_id!r} already holds blocks")
        if self._promised.get(seq_id, 0) < len(blocks):
            raise ValueError(
                f"attach: sequence {seq_id!r} has no reservation covering {len(blocks)} blocks"
            )
        if len(set(blocks)) != len(blocks) or any(b not in self._hash_of for b in blocks):
            raise ValueError(f"attach: blocks must be distinct cached blocks, got {blocks}")
        before = self._own_reserved(seq_id, 0)
        table = self._tables.setdefault(seq_id, [])
        for block in blocks:
            if self._refs[block] == 0:
                del self._lru[block]
            self._refs[block] += 1
            table.append(block)
        self._reserved -= before - self._own_reserved(seq_id, len(table))
        return table

    def register(self, seq_id: Hashable, tokens: Sequence[int]) -> int:
        """Cache the sequence's blocks that hold ``tokens`` (its KV covers exactly them):
        full blocks under their chain hashes, a partial last block under its tail hash. A
        hash already cached is left as it is; a block may have several names (a tail named at
        a prompt boundary, then the longer tail or the full block at the end). The names
        added."""
        table = self._tables.get(seq_id, [])
        if len(table) < self.blocks_needed(len(tokens)):
            return 0
        hashes = hash_blocks(tokens, self.block_size)
        named = [(h, table[i]) for i, h in enumerate(hashes)]
        if len(tokens) % self.block_size:
            named.append((self.tail_hash(tokens, len(tokens), hashes), table[len(hashes)]))
        count = 0
        for h, block in named:
            if h not in self._block_of:
                self._block_of[h] = block
                self._hash_of.setdefault(block, set()).add(h)
                count += 1
        return count

    def forget(self) -> None:
        """Drop every hash (held blocks stay held; the LRU's blocks become free)."""
        for block in self._lru:
            self._free.append(block)
        self._lru.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def check(self) -> None:
        """Assert the invariants (tests call it after every operation)."""
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                refs[block] += 1
        assert refs == self._refs, "a reference count is out of step with the tables"
        held = {b for b in range(self.num_blocks) if refs[b]}
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not (free & lru) and not (held & (free | lru)), "a block is in two places"
        assert len(held) + len(free) + len(lru) == self.num_blocks, "a block is lost"
        assert lru == {b for b in self._hash_of if not refs[b]}, "the LRU is out of step"
        assert not (free & set(self._hash_of)), "a free block has a hash"
        names = {h: b for b, hs in self._hash_of.items() for h in hs}
        assert names == self._block_of and all(self._hash_of.values()), "names out of step"
        own = sum(self._own_reserved(s, len(self._tables.get(s, ()))) for s in self._promised)
        assert own == self._reserved, "the reservation count is out of step"
        assert 0 <= self._reserved <= self._num_takeable(), "over-committed"


class HybridPrefixCache(StatePrefixCache):
    """``StatePrefixCache`` for a model with attention layers: a hit also shares (or, for
    a tail, copies) the attention KV blocks of the restored prefix (``kv``)."""

    def __init__(self, lines: Iterable[int], block_size: int, kv: PrefixKVCacheManager):
        super().__init__(lines, block_size)
        self.kv = kv
        self.kv_copies: list[tuple[int, int]] = []  # (cached tail block, fresh block)

    def _candidates(self, prompt: Sequence[int], hashes=None) -> Iterator[tuple[int, bytes]]:
        """Committed Mamba checkpoints that a prefix of ``prompt[:-1]`` matches, longest
        first: (their length, their key)."""
        limit, bs = len(prompt) - 1, self.block_size
        hashes = self._lookup_hashes(prompt, hashes)
        for i in range(len(hashes), -1, -1):
            parent = hashes[i - 1] if i else ROOT_HASH
            for t in sorted(self._tails.get(parent, ()), reverse=True):
                if i * bs + t <= limit:
                    h = hash_block(parent, prompt[i * bs : i * bs + t])
                    if h in self.index:
                        yield i * bs + t, h
            if i and hashes[i - 1] in self.index:
                yield i * bs, hashes[i - 1]

    def lookup_blocks(self, prompt: Sequence[int], hashes=None):
        """(tokens, Mamba key, (full blocks, tail block)) of the longest prefix with a
        checkpoint and all its KV cached, or (0, None, None)."""
        kv_hashes = hash_blocks(prompt[: len(prompt) - 1], self.kv.block_size)
        for n, key in self._candidates(prompt, hashes):
            blocks = self.kv.cached_blocks(prompt, n, kv_hashes)
            if blocks is not None:
                return n, key, blocks
        return 0, None, None

    def lookup(self, prompt: Sequence[int], hashes=None) -> tuple[int, bytes | None]:
        n, key, _ = self.lookup_blocks(prompt, hashes)
        return n, key

    def restore(
        self, prompt: Sequence[int], slot: int, seq_id: Hashable = None, hashes=None
    ) -> int:
        """As ``StatePrefixCache.restore``, and the sequence ``seq_id`` (reserved, with no
        blocks yet) starts with the prefix's blocks: the full ones shared, the tail one a
        fresh block with a queued copy."""
        n, key, blocks = self.lookup_blocks(prompt, hashes)
        self.index.record(len(prompt), n)
        if key is None:
            return 0
        self.copies.append((self.index.acquire(key), slot))
        self._pinned.append(key)
        full, tail = blocks
        self.kv.attach(seq_id, full)
        if tail is not None:
            fresh = self.kv.allocate(seq_id, n)[-1]
            if fresh != tail:  # else the tail itself was evicted into it: nothing to copy
                self.kv_copies.append((tail, fresh))
        return n

    def checkpoint(
        self, token_ids: Sequence[int], num_computed: int, slot: int, seq_id: Hashable = None
    ) -> bool:
        """As ``StatePrefixCache.checkpoint``, and when the Mamba checkpoint is written (or
        was there) the sequence's blocks are registered under the same tokens."""
        tokens = token_ids[:num_computed]
        written, key = self._checkpoint(tokens, num_computed, slot)
        if key is not None and (written or key in self.index):
            self.kv.register(seq_id, tokens)
        return written

    def write_prompt(self, key: bytes, slot: int, tokens: Sequence[int], seq_id=None) -> bool:
        """As ``StatePrefixCache.write_prompt``, and when the checkpoint is written (or was
        there) the running sequence's blocks holding ``tokens`` are named too (a partial
        block's first tokens never change after this step, and a hit copies that block)."""
        written = self.write(key, slot)
        if written or key in self.index:
            self.kv.register(seq_id, tokens)
        return written

    def take_kv_copies(self) -> list[tuple[int, int]]:
        """The queued KV block copies, for the step being dispatched."""
        copies, self.kv_copies = self.kv_copies, []
        return copies

    def drop_all(self) -> None:
        super().drop_all()
        self.kv_copies = []
        self.kv.forget()

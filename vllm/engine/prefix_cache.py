"""Prefix caching, engine side: block hashes as a chain and the index of state checkpoints.

Plain data and decisions, no device work (``docs/prefix_caching.md`` has the design).

- **Hash chain** (block_hash.py, re-exported here). A prompt is cut into full blocks of
  ``block_size`` tokens; block ``i``'s hash covers its parent's hash, its own tokens and
  the request's extra keys (anything besides the tokens that changes the state, e.g. a
  LoRA or a multimodal input's id), so one hash names the whole prefix up to the end of
  its block. A partial last block has no hash: only full blocks are cached.
- **Checkpoint index.** A budget of extra state-pool lines (beyond the sequences' lines)
  holds (conv, SSM) checkpoints, one per cached block hash: the state after the last token
  of that block. An entry is *pending* from ``reserve`` (a line is chosen, the engine
  schedules the copy into it) until ``commit`` (the copy is enqueued on the device, ahead of
  any later step's reads), and only committed entries match. A sequence restoring from a
  line holds a reference (``acquire``/``release``) so that the line is neither evicted nor
  rewritten before its copy has run. Unreferenced committed entries sit in an LRU; when no
  line is free, ``reserve`` evicts the least recently used one. Refused calls change
  nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm.engine.block_hash import (  # noqa: F401 (re-exported: the engine's importers)
    ROOT_HASH,
    _check_int,
    boundary_hash,
    hash_block,
    hash_blocks,
    max_hit_blocks,
)


@dataclass
class _Entry:
    line: int
    refs: int = 0
    committed: bool = False


class CheckpointIndex:
    """Block hash -> state-pool line of its checkpoint, under a budget of ``lines``."""

    def __init__(self, lines: Iterable[int]):
        lines = list(lines)
        if not lines:
            raise ValueError("lines must name at least one checkpoint line of the state pool")
        for line in lines:
            _check_int("lines[i]", line, 1)  # line 0 is the null line
        if len(set(lines)) != len(lines):
            raise ValueError(f"lines must be distinct, got {lines}")
        self.lines = tuple(lines)
        self._free = list(reversed(lines))  # popped from the end: the first line first
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # committed, refs == 0; oldest first
        # Prefix-cache counters, in tokens (vLLM's prefix_cache_queries / _hits).
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # --- queries --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: bytes) -> bool:
        e = self._entries.get(block_hash)
        return e is not None and e.committed

    @property
    def num_free_lines(self) -> int:
        """Lines holding no entry."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Committed entries no sequence references: a ``reserve`` may take their lines."""
        return len(self._lru)

    def line_of(self, block_hash: bytes) -> int | None:
        e = self._entries.get(block_hash)
        return e.line if e is not None else None

    def refs_of(self, block_hash: bytes) -> int:
        e = self._entries.get(block_hash)
        return e.refs if e is not None else 0

    def match(self, block_hashes: Sequence[bytes]) -> tuple[int, int | None]:
        """The longest checkpointed prefix: (number of blocks it covers, its line), or
        (0, None). A chained hash names its whole prefix, so the last committed one wins;
        earlier blocks need no checkpoint of their own. Pure: counts and LRU order are left
        alone (``record`` and ``acquire`` do that)."""
        for i in range(len(block_hashes) - 1, -1, -1):
            e = self._entries.get(block_hashes[i])
            if e is not None and e.committed:
                return i + 1, e.line
        return 0, None

    # --- accounting -----------------------------------------------------------------

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup, in tokens: the prompt's tokens queried and those restored."""
        _check_int("num_query_tokens", num_query_tokens, 0)
        _check_int("num_hit_tokens", num_hit_tokens, 0)
        if num_hit_tokens > num_query_tokens:
            raise ValueError(
                f"num_hit_tokens ({num_hit_tokens}) exceeds num_query_tokens ({num_query_tokens})"
            )
        self.queries += num_query_tokens
        self.hits += num_hit_tokens

    # --- references -----------------------------------------------------------------

    def _get(self, block_hash: bytes, what: str) -> _Entry:
        e = self._entries.get(block_hash)
        if e is None:
            raise KeyError(f"{what}: block hash {block_hash.hex()[:16]}... is not in the index")
        return e

    def acquire(self, block_hash: bytes) -> int:
        """Pin a committed checkpoint for a sequence restoring from it; returns its line."""
        e = self._get(block_hash, "acquire")
        if not e.committed:
            raise ValueError("acquire: the checkpoint is still pending (not committed)")
        if e.refs == 0:
            del self._lru[block_hash]
        e.refs += 1
        return e.line

    def release(self, block_hash: bytes) -> None:
        """Drop one pin; the last one puts the entry at the LRU's young end."""
        e = self._get(block_hash, "release")
        if e.refs == 0:
            raise ValueError("release: the checkpoint holds no reference (double release?)")
        e.refs -= 1
        if e.refs == 0:
            self._lru[block_hash] = None

    # --- writing --------------------------------------------------------------------

    def reserve(self, block_hash: bytes) -> int | None:
        """A line for a new checkpoint of ``block_hash``, pending until ``commit``: a free
        line, else the least recently used unreferenced entry's line (evicted). None when
        the hash already has an entry (pending or committed: nothing to write; a committed
        unreferenced one is refreshed in the LRU) or when every line is pinned or pending."""
        e = self._entries.get(block_hash)
        if e is not None:
            if e.committed and e.refs == 0:
                self._lru.move_to_end(block_hash)
            return None
        if self._free:
            line = self._free.pop()
        elif self._lru:
            victim, _ = self._lru.popitem(last=False)
            line = self._entries.pop(victim).line
            self.evictions += 1
        else:
            return None
        self._entries[block_hash] = _Entry(line)
        return line

    def demote(self, block_hash: bytes) -> None:
        """An unreferenced committed entry becomes the next to be evicted (nothing for a
        pinned, pending or unknown one)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash, last=False)

    def commit(self, block_hash: bytes) -> None:
        """The copy into the pending entry's line is enqueued: the entry may match now."""
        e = self._get(block_hash, "commit")
        if e.committed:
            raise ValueError("commit: the checkpoint is already committed")
        e.committed = True
        if e.refs == 0:
            self._lru[block_hash] = None

    def discard(self, block_hash: bytes) -> None:
        """Drop a pending entry whose copy was never enqueued (its request was aborted)."""
        e = self._get(block_hash, "discard")
        if e.committed:
            raise ValueError(
                "discard: the checkpoint is committed; only a pending one can be discarded"
            )
        del self._entries[block_hash]
        self._free.append(e.line)

    def clear(self) -> None:
        """Forget every unreferenced committed entry (e.g. after a weight reload); pinned
        and pending ones stay."""
        for h in list(self._lru):
            self._free.append(self._entries.pop(h).line)
        self._lru.clear()

    def check(self) -> None:
        """Assert the invariants (tests call it after every operation)."""
        lines = [e.line for e in self._entries.values()] + self._free
        assert sorted(lines) == sorted(self.lines), "a line is lost or held twice"
        lru = {h for h, e in self._entries.items() if e.committed and e.refs == 0}
        assert lru == set(self._lru), "the LRU is out of step with the entries"
        assert all(e.committed or e.refs == 0 for e in self._entries.values())


class StatePrefixCache:
    """The engine core's prefix cache of Mamba states (pure Mamba models; first slice).

    - At admission (``restore``), a request's prompt is looked up: the longest prefix of at
      most ``len(prompt) - 1`` tokens with a committed checkpoint is restored by a copy of
      the checkpoint's line into the sequence's line, and the sequence starts with those
      tokens computed.
    - At the end of a request that stopped or ran out of tokens (``checkpoint``), the state
      of its line, which covers its first ``num_computed_tokens`` tokens (prompt and
      output), is copied into a checkpoint line, keyed by the hash of exactly those tokens:
      the full blocks' chain plus, when the length is off the grid, a *tail* hash of the
      last partial block under its parent. ``_tails`` lists the tail lengths seen under
      each parent, so a lookup tries only those.

    The copies are device work: they queue in ``copies`` ((src line, dst line), in order)
    and go with the next dispatched step, ahead of its forward. Writes are queued when a
    request finishes (while its line still holds its state) and restores when one is
    admitted, so a restore that reads a checkpoint written in the same step comes after the
    write, and a line freed by a finished request is copied out before a new owner's
    forward writes it. An entry is therefore committed as soon as its copy is queued.
    """

    def __init__(self, lines: Iterable[int], block_size: int):
        self.block_size = _check_int("block_size", block_size, 1)
        self.index = CheckpointIndex(lines)
        self.copies: list[tuple[int, int]] = []
        self._pinned: list[bytes] = []
        self._tails: dict[bytes, set[int]] = {}

    def _key(self, tokens: Sequence[int], length: int, hashes: Sequence[bytes]) -> bytes:
        full, tail = divmod(length, self.block_size)
        parent = hashes[full - 1] if full else ROOT_HASH
        if not tail:
            return parent
        return hash_block(parent, tokens[full * self.block_size : length])

    def _lookup_hashes(self, prompt: Sequence[int], hashes) -> list[bytes]:
        """The chain hashes of the full blocks of ``prompt[:-1]``: a prefix of ``hashes``
        (the whole prompt's, when the caller has them), else computed."""
        limit = len(prompt) - 1
        if hashes is None:
            return hash_blocks(prompt[:limit], self.block_size)
        return list(hashes[: limit // self.block_size])

    def lookup(self, prompt: Sequence[int], hashes=None) -> tuple[int, bytes | None]:
        """(tokens of the longest restorable prefix, its key), or (0, None); ``hashes``:
        the prompt's full-block hashes, if known."""
        limit = len(prompt) - 1
        bs = self.block_size
        hashes = self._lookup_hashes(prompt, hashes)
        for i in range(len(hashes), -1, -1):
            parent = hashes[i - 1] if i else ROOT_HASH
            tails = self._tails.get(parent)
            for t in sorted(tails or (), reverse=True):
                if i * bs + t > limit:
                    continue
                h = hash_block(parent, prompt[i * bs : i * bs + t])
                if h in self.index:
                    return i * bs + t, h
            if i and hashes[i - 1] in self.index:
                return i * bs, hashes[i - 1]
        return 0, None

    def restore(self, prompt: Sequence[int], slot: int, hashes=None) -> int:
        """Look the prompt up, count the query, and on a hit pin the checkpoint and queue
        its copy into ``slot``; the tokens restored (0 on a miss)."""
        n, key = self.lookup(prompt, hashes)
        self.index.record(len(prompt), n)
        if key is not None:
            self.copies.append((self.index.acquire(key), slot))
            self._pinned.append(key)
        return n

    def checkpoint(self, token_ids: Sequence[int], num_computed: int, slot: int) -> bool:
        """Queue a checkpoint of ``slot``, whose state covers ``token_ids[:num_computed]``;
        False when there is nothing to write (no tokens, a token not read yet, the key
        already cached, or every line pinned)."""
        return self._checkpoint(token_ids[:num_computed], num_computed, slot)[0]

    def _checkpoint(self, tokens: Sequence[int], num_computed: int, slot: int):
        """``checkpoint``'s work: (written, the key or None when there is nothing to key)."""
        if num_computed < 1 or len(tokens) < num_computed or min(tokens) < 0:
            return False, None
        hashes = hash_blocks(tokens, self.block_size)
        key = self._key(tokens, num_computed, hashes)
        if not self.write(key, slot):
            return False, key
        self._add_tail(num_computed, hashes)
        return True, key

    def _add_tail(self, length: int, hashes: Sequence[bytes]) -> None:
        """A key of ``length`` tokens off the grid was written: its tail length is listed
        under its last full block (``hashes``: at least the full blocks of the ``length``
        tokens), so a lookup tries it."""
        full, tail = divmod(length, self.block_size)
        if tail:
            parent = hashes[full - 1] if full else ROOT_HASH
            self._tails.setdefault(parent, set()).add(tail)

    def write(self, key: bytes, slot: int) -> bool:
        """Queue a copy of ``slot`` into a checkpoint line for ``key`` and commit it (the copy
        runs ahead of any restore reading it); False when the key is cached or every line
        is pinned or pending."""
        line = self.index.reserve(key)
        if line is None:
            return False
        self.copies.append((slot, line))
        self.index.commit(key)
        return True

    def write_prompt(self, key: bytes, slot: int, tokens: Sequence[int], seq_id=None) -> bool:
        """A prompt-boundary checkpoint of ``slot`` (covering ``tokens``): ``write``;
        ``HybridPrefixCache`` also names the sequence ``seq_id``'s KV blocks of ``tokens``."""
        return self.write(key, slot)

    def write_prompt_end(self, tokens: Sequence[int], slot: int, hashes, seq_id=None):
        """A checkpoint of ``slot`` covering exactly ``tokens`` (a whole prompt; its full
        blocks hash to ``hashes``), keyed as an end-of-request checkpoint is (a tail key off
        the grid), written through ``write_prompt`` (a hybrid names its KV blocks); its key,
        or None when nothing was written."""
        n = len(tokens)
        key = self._key(tokens, n, hashes) if n else None
        if key is None or not self.write_prompt(key, slot, tokens, seq_id):
            return None
        self._add_tail(n, hashes)
        return key

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued copies, for the step being dispatched; the restores' pins end here
        (a later write to their lines is queued after these copies)."""
        copies, self.copies = self.copies, []
        for key in self._pinned:
            self.index.release(key)
        self._pinned = []
        return copies

    def drop_all(self) -> None:
        """Forget every checkpoint (a dispatch failed: its copies may not have run)."""
        self.take_copies()
        self.index.clear()
        self._tails.clear()

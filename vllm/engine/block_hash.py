"""Block hashes of prefix caching: a prompt cut into full blocks of ``block_size`` tokens,
block ``i``'s hash covering its parent's hash, its own tokens and the request's extra keys
(anything besides the tokens that changes the state, e.g. a LoRA or a multimodal input's
id), so that one hash names the whole prefix up to the end of its block. sha256, so that
processes agree (``hash()`` is seeded per process). prefix_cache.py re-exports these."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The chain's root: the parent of a prompt's first block.
ROOT_HASH = b"\x00" * 32


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """The hash of one block: sha256 over (parent hash, token ids, extra keys).

    Deterministic across processes (no ``hash()``, whose seed differs per process), so that
    an engine core in a process of its own and the front end agree."""
    if not isinstance(parent, bytes) or len(parent) != 32:
        raise ValueError(f"parent must be a 32-byte hash, got {parent!r}")
    h = hashlib.sha256(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    # Each token as 8 little-endian bytes, packed in one call (a per-token update cost ~0.5
    # us a token, a millisecond per 2k-token prompt on the engine's loop).
    if not all(type(t) is int for t in tokens):  # no bool, no numpy ints, no floats
        bad = next(t for t in tokens if type(t) is not int)
        raise ValueError(f"tokens must be non-negative ints, got {bad!r}")
    try:
        h.update(struct.pack(f"<{len(tokens)}Q", *tokens))
    except struct.error:
        bad = next(t for t in tokens if not 0 <= t < 2**64)
        raise ValueError(f"tokens must be non-negative ints, got {bad!r}") from None
    h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    parent: bytes = ROOT_HASH,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on, chained
    from ``parent`` (the hash of block ``start_block - 1``, or the root). A growing sequence
    extends its list by passing its last hash and the number of blocks it already has."""
    _check_int("block_size", block_size, 1)
    _check_int("start_block", start_block, 0)
    out: list[bytes] = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], extra_keys)
        out.append(parent)
    return out


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """How many leading blocks a prompt may restore: at least one prompt token must still be
    computed, since the first output token is sampled from the last prompt token's logits."""
    _check_int("num_prompt_tokens", num_prompt_tokens, 1)
    _check_int("block_size", block_size, 1)
    return (num_prompt_tokens - 1) // block_size


def boundary_hash(
    block_hashes: Sequence[bytes], num_computed_tokens: int, block_size: int
) -> bytes | None:
    """The hash whose checkpoint a sequence can write now: that of the block ending exactly
    at ``num_computed_tokens``, or None when its state is not on a block boundary (the
    sequence's state is only a valid checkpoint at the end of a step on the grid)."""
    _check_int("num_computed_tokens", num_computed_tokens, 0)
    _check_int("block_size", block_size, 1)
    if num_computed_tokens == 0 or num_computed_tokens % block_size:
        return None
    b = num_computed_tokens // block_size
    return block_hashes[b - 1] if b <= len(block_hashes) else None

"""Per-step attention metadata, built once per step by the model runner, read by every layer.

``AttentionMetadataBuilder.build`` takes host data only (each sequence's query length,
its context length, its block table) and writes everything the kernels read into ONE
host buffer (pinned on CUDA), copied to the device with ONE non-blocking copy into a
buffer the builder allocated once at its maximum size. The block tables travel compact:
only the step's widest table's columns (``max_blocks_per_seq`` follows ``max_model_len``,
16384 columns for Bamba-9B's 262144 tokens, while a step's sequences use a few), and a
device copy puts them into the full-width table. The returned tensors are views of
persistent device buffers: a CUDA graph captured on them reads whatever the latest
``build`` wrote, so a step's metadata is valid until the next ``build``.

Sequences come in batch order, decodes (one query token) first. Padding for CUDA-graph
buckets: ``pad_seqs_to`` adds sequences with no tokens and seq_len 0 (query_start_loc
repeats its last value), ``pad_tokens_to`` adds tokens owned by no sequence with slot -1.
The kernels leave the cache alone for those and give them output 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 4  # int32 elements: every field starts 16-byte aligned, as a fresh allocation does


@dataclass
class AttentionMetadata:
    """One step. Device tensors (padded sizes; views of the builder's persistent buffer):
    ``query_start_loc`` (num_padded_seqs+1,) int32, ``seq_lens`` (num_padded_seqs,) int32
    (tokens of the sequence including this step's), ``block_table`` (num_padded_seqs,
    max_blocks_per_seq) int32 (columns past a sequence's blocks are stale, never read),
    ``slot_mapping`` (num_padded_tokens,) int64 (block * block_size + offset, -1 for
    padding). Host ints describe the real batch: ``num_seqs``, ``num_decodes`` (the first
    sequences), ``num_actual_tokens``, ``max_query_len``, ``max_seq_len``."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_seqs: int
    num_decodes: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @property
    def num_padded_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_padded_tokens(self) -> int:
        return self.slot_mapping.shape[0]


@dataclass
class AttentionPlan:
    """The host half of a step's metadata (``AttentionMetadataBuilder.prepare``): ``host``,
    the builder's host buffer prefix to upload (int32, ``end`` entries), and the sizes."""

    host: torch.Tensor
    end: int
    padded_seqs: int
    padded_tokens: int
    width: int
    num_seqs: int
    num_decodes: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class AttentionMetadataBuilder:
    """Builds ``AttentionMetadata``; owns the host and device buffers, sized once for
    ``max_num_seqs`` sequences, ``max_num_batched_tokens`` tokens and block tables of
    ``max_blocks_per_seq`` columns. ``num_blocks``, when given, is the KV cache's block
    count, and block ids are checked against it."""

    def __init__(
        self,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        device: torch.device | str,
        num_blocks: int | None = None,
    ):
        self.block_size = _positive_int("block_size", block_size)
        self.max_num_seqs = _positive_int("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive_int(
            "max_num_batched_tokens", max_num_batched_tokens
        )
        self.max_blocks_per_seq = _positive_int("max_blocks_per_seq", max_blocks_per_seq)
        self.num_blocks = None if num_blocks is None else _positive_int("num_blocks", num_blocks)
        self.device = torch.device(device)
        s, t, w = max_num_seqs, max_num_batched_tokens, max_blocks_per_seq
        # int32 layout: slot_mapping (as int64 pairs) | query_start_loc | seq_lens | the
        # step's block tables, (num_padded_seqs, width) compact. The tables come last so a
        # step copies only the prefix up to its last row; the device then spreads them
        # into the full-width table (``_dev_table``), which is what the kernels read.
        self._off_qsl = _aligned(2 * t)
        self._off_lens = self._off_qsl + _aligned(s + 1)
        self._off_table = self._off_lens + _aligned(s)
        size = self._off_table + s * w
        pin = self.device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self._dev = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._dev_table = torch.zeros(s, w, dtype=torch.int32, device=self.device)
        self._np = self._host.numpy()
        self._copied: torch.cuda.Event | None = None
        self.num_builds = 0
        self.num_own_copies = 0  # host-to-device copies of its own (build, not prepare)

    def _fields(self, buf: torch.Tensor, rows: int, width: int):
        """slot_mapping, query_start_loc, seq_lens and the compact (rows, width) tables."""
        t, s = self.max_num_batched_tokens, self.max_num_seqs
        slots = buf[: 2 * t].view(torch.int64)
        qsl = buf[self._off_qsl : self._off_qsl + s + 1]
        lens = buf[self._off_lens : self._off_lens + s]
        table = buf[self._off_table : self._off_table + rows * width].view(rows, width)
        return slots, qsl, lens, table

    def build(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        num_decodes: int,
        pad_tokens_to: int | None = None,
        pad_seqs_to: int | None = None,
    ) -> AttentionMetadata:
        """The step's metadata. ``context_lens[i]``: tokens of sequence i already in the
        cache before this step; ``block_tables[i]``: its physical blocks in order, at
        least enough for context + query tokens. The first ``num_decodes`` sequences have
        one query token each. The builder copies its host buffer itself; the model runner
        instead calls ``prepare``, uploads ``plan.host`` with its step, then ``finish``."""
        plan = self.prepare(
            query_lens, context_lens, block_tables, num_decodes, pad_tokens_to, pad_seqs_to
        )
        self._dev[: plan.end].copy_(plan.host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.num_own_copies += 1
        return self.finish(plan)

    def prepare(
        self,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        num_decodes: int,
        pad_tokens_to: int | None = None,
        pad_seqs_to: int | None = None,
    ) -> AttentionPlan:
        """The host half of ``build`` (same arguments): checks, then the step's fields
        written into the host buffer; ``plan.host`` is the prefix the device needs (copy
        it before the next ``prepare``, which rewrites the buffer)."""
        n = len(query_lens)
        if len(context_lens) != n or len(block_tables) != n:
            raise ValueError(
                f"query_lens, context_lens and block_tables must have one entry per sequence, "
                f"got {n}, {len(context_lens)} and {len(block_tables)}"
            )
        if n > self.max_num_seqs:
            raise ValueError(f"{n} sequences exceed max_num_seqs={self.max_num_seqs}")
        q = np.asarray(query_lens, dtype=np.int64).reshape(n)
        c = np.asarray(context_lens, dtype=np.int64).reshape(n)
        if n and q.min() < 1:
            raise ValueError(f"query_lens must be >= 1, sequence {int(q.argmin())} has {q.min()}")
        if n and c.min() < 0:
            raise ValueError(f"context_lens must be >= 0, sequence {int(c.argmin())} has {c.min()}")
        if isinstance(num_decodes, bool) or not isinstance(num_decodes, int):
            raise ValueError(f"num_decodes must be an int, got {num_decodes!r}")
        if not 0 <= num_decodes <= n:
            raise ValueError(f"num_decodes={num_decodes} must be in [0, {n}]")
        if num_decodes and q[:num_decodes].max() != 1:
            raise ValueError(
                f"the first num_decodes={num_decodes} sequences are decodes and must have one "
                f"query token each, got query_lens {q[:num_decodes].tolist()}"
            )
        num_tokens = int(q.sum())
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"{num_tokens} tokens exceed max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        padded_tokens = self._pad(
            "pad_tokens_to",
            pad_tokens_to,
            num_tokens,
            self.max_num_batched_tokens,
            "max_num_batched_tokens",
        )
        padded_seqs = self._pad("pad_seqs_to", pad_seqs_to, n, self.max_num_seqs, "max_num_seqs")
        seq_lens = c + q
        need = -(-seq_lens // self.block_size)
        for i, table in enumerate(block_tables):
            if len(table) < need[i]:
                raise ValueError(
                    f"sequence {i}: {seq_lens[i]} tokens need {need[i]} blocks of "
                    f"{self.block_size}, its block table has {len(table)}"
                )
            if need[i] > self.max_blocks_per_seq:
                raise ValueError(
                    f"sequence {i}: {seq_lens[i]} tokens need {need[i]} blocks, more than "
                    f"max_blocks_per_seq={self.max_blocks_per_seq}"
                )

        # A refused step may leave the host buffer half written; the device buffer, which
        # is all a kernel reads, changes only with the copy below.
        if self._copied is not None:  # the previous step's copy must have read the buffer
            self._copied.synchronize()
        # The compact tables' width: the most blocks a sequence of this step reads.
        w = max(1, int(need.max())) if n else 1
        slots, qsl, lens, table = (f.numpy() for f in self._fields(self._host, padded_seqs, w))
        for i, row in enumerate(block_tables):
            k = int(need[i])
            table[i, :k] = row[:k]
        used = table[:n]
        blocks = used[np.arange(w)[None, :] < need[:, None]]  # the entries the step reads
        if blocks.size:
            lo, hi = int(blocks.min()), int(blocks.max())
            if lo < 0 or (self.num_blocks is not None and hi >= self.num_blocks):
                raise ValueError(
                    f"block_tables hold block ids in [{lo}, {hi}], outside "
                    f"[0, num_blocks={self.num_blocks})"
                )
        table[n:padded_seqs] = 0
        qsl[0] = 0
        qsl[1 : n + 1] = np.cumsum(q)
        qsl[n + 1 : padded_seqs + 1] = num_tokens
        lens[:n] = seq_lens
        lens[n:padded_seqs] = 0
        seq_of_token = np.repeat(np.arange(n), q)
        starts = qsl[:n].astype(np.int64)
        pos = c[seq_of_token] + np.arange(num_tokens) - starts[seq_of_token]
        blk = used[seq_of_token, pos // self.block_size].astype(np.int64)
        slots[:num_tokens] = blk * self.block_size + pos % self.block_size
        slots[num_tokens:padded_tokens] = -1

        end = self._off_table + padded_seqs * w
        return AttentionPlan(
            host=self._host[:end],
            end=end,
            padded_seqs=padded_seqs,
            padded_tokens=padded_tokens,
            width=w,
            num_seqs=n,
            num_decodes=num_decodes,
            num_actual_tokens=num_tokens,
            max_query_len=int(q.max()) if n else 0,
            max_seq_len=int(seq_lens.max()) if n else 0,
        )

    def finish(
        self, plan: AttentionPlan, device_host: torch.Tensor | None = None
    ) -> AttentionMetadata:
        """The metadata of ``plan``. ``device_host``: the device copy of ``plan.host`` made
        by the caller's upload, moved into the builder's persistent buffer here (a device
        copy), so a CUDA graph captured on that buffer sees it; None: already there."""
        if device_host is not None:
            self._dev[: plan.end].copy_(device_host)
        self.num_builds += 1
        padded_seqs, w = plan.padded_seqs, plan.width
        d_slots, d_qsl, d_lens, d_compact = self._fields(self._dev, padded_seqs, w)
        if padded_seqs:
            # Columns past w keep earlier steps' entries: past every sequence's blocks, so
            # never read.
            self._dev_table[:padded_seqs, :w].copy_(d_compact)
        return AttentionMetadata(
            query_start_loc=d_qsl[: padded_seqs + 1],
            seq_lens=d_lens[:padded_seqs],
            block_table=self._dev_table[:padded_seqs],
            slot_mapping=d_slots[: plan.padded_tokens],
            num_seqs=plan.num_seqs,
            num_decodes=plan.num_decodes,
            num_actual_tokens=plan.num_actual_tokens,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
        )

    @staticmethod
    def _pad(name: str, value, actual: int, limit: int, limit_name: str) -> int:
        if value is None:
            return actual
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be None or an int, got {value!r}")
        if not actual <= value <= limit:
            raise ValueError(f"{name}={value} must be in [{actual}, {limit_name}={limit}]")
        return value

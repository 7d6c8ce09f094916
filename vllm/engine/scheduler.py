"""Scheduler: continuous batching, ONE mixed batch per step, first come first served.

Each step takes, in this order and under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. every running sequence that decodes (one token each; they come first so the model
   needs no reordering gather, see ``Mamba2Metadata``), unless it has all its tokens
   (the last of them still pending on the device: it finishes when the host reads it);
2. running sequences whose prompt is still being prefilled, the next chunk of each;
3. waiting requests in arrival order, each given a slot and a first chunk, while a slot
   is free and budget is left. The head of the queue is never skipped (FCFS).

A running sequence always owns its slot and ``max_num_batched_tokens >= max_num_seqs``, so
every running decode fits in every step: admission never preempts. ``finish`` frees the
slot at once, so the next step can admit a waiting request into it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vllm.engine.sequence import Sequence, SequenceStatus
from vllm.engine.state_manager import SlotManager


@dataclass
class ScheduledBatch:
    """One step: ``seqs[i]`` computes its next ``num_tokens[i]`` tokens; decodes first."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots = SlotManager(max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        for seq in self.running:
            if seq.is_decode and seq.wants_tokens:
                seqs.append(seq)
                counts.append(1)
                budget -= 1
        num_decodes = len(seqs)
        for seq in self.running:
            if budget == 0:
                break
            if not seq.is_decode and seq.num_uncomputed > 0:
                n = min(seq.num_uncomputed, budget)
                seqs.append(seq)
                counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and self.slots.num_free > 0:
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, num_decodes)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence, running or waiting; a running one gives its slot back now."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.slots.free(seq.slot)
        seq.slot = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

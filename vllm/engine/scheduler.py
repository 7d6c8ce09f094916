"""Scheduler: continuous batching, ONE mixed batch per step, first come first served.

Each step takes, in this order and under ``max_num_batched_tokens`` and ``max_num_seqs``:

1. every running sequence that decodes (one token each), unless it has all its tokens
   (the last of them still pending on the device: it finishes when the host reads it);
2. running sequences whose prompt is still being prefilled, the next chunk of each;
3. waiting requests in arrival order, each given a slot and a first chunk, while a slot
   is free, the KV cache can take it (below) and budget is left. The head of the queue is
   never skipped (FCFS).

A chunk is what is left of the prompt, cut to the budget left and, when
``long_prefill_token_threshold`` N > 0 (vLLM's ``--long-prefill-token-threshold``), to N:
no sequence computes more than N tokens in one step, the rest of its prompt goes on in
later steps (its state carries over, as for any chunk). The budget of the step is not
changed by it: the tokens a long prompt leaves go to the next sequences of steps 2 and 3,
so a step still carries up to ``max_num_batched_tokens`` tokens when several prompts are
being prefilled. Decodes (one token) are never cut, so every rule below holds for any N.
With ``max_mixed_step_ratio`` (``step_budget.py``) each prompt's chunk beside D decodes is
also cut to ``prefill_cap(D)``, a threshold that follows the decodes, so that a step with
one prompt chunk stays within a multiple of a decode-only step's time.

The batch's rows are in the canonical order of ``Mamba2Metadata``: first every one-token
row that continues a sequence (the decodes, and a prefill chunk the budget or N cut to
one token), then the others; so the model needs no reordering gather, and the attention
metadata, built in the same order, matches.

A running sequence always owns its slot and ``max_num_batched_tokens >= max_num_seqs``, so
every running decode fits in every step: admission never preempts. With a KV cache
(``kv``: the ``KVCacheManager`` of a model with attention layers) admission also reserves
the sequence's worst case, prompt + max_tokens capped at ``max_model_len``
(``kv.reserve``), and admits only while that fits beside the reservations of all running
sequences (``kv.can_reserve``); the blocks themselves are taken (``kv.allocate``) only as
a step is about to write the tokens, so a sequence never holds blocks for tokens it does
not have, and no step ever runs out of blocks. ``finish``
frees the slot, the blocks and the reservation at once, so the next step can admit a
waiting request in their place.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vllm.engine.sequence import Sequence, SequenceStatus
from vllm.engine.state_manager import SlotManager


@dataclass
class ScheduledBatch:
    """One step: ``seqs[i]`` computes its next ``num_tokens[i]`` tokens. The first
    ``num_decodes`` rows are one-token continuations (decodes). ``block_tables[i]`` (with a
    KV cache) lists the blocks that hold ``seqs[i]``'s tokens, this step's included."""

    seqs: list[Sequence]
    num_tokens: list[int]
    num_decodes: int
    block_tables: list[list[int]] | None = None
    prefill_capped: bool = False  # max_mixed_step_ratio's cap cut a prompt's chunk

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        kv=None,
        max_model_len: int | None = None,
        long_prefill_token_threshold: int = 0,
        on_admit=None,
        cut_chunk=None,
        step_budget=None,
    ):
        """``kv``: the ``KVCacheManager`` of a model with attention layers (None: none).
        ``long_prefill_token_threshold``: the most prompt tokens of one sequence in a step
        (0: no cap but the budget). ``on_admit(seq)``: called when a waiting sequence gets
        its slot, before its first chunk is cut (the prefix cache restores its state there
        and sets ``num_computed_tokens``). ``cut_chunk(seq, n)``: a prefill chunk of ``n``
        tokens shortened (to 1..n) after the budget and the threshold cut it (the prefix
        cache ends chunks on the block boundaries it checkpoints). ``step_budget``: a
        ``MixedStepBudget`` (``max_mixed_step_ratio``; None: none)."""
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: off), got "
                f"{long_prefill_token_threshold}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots = SlotManager(max_num_seqs)
        self.kv = kv
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.on_admit = on_admit
        self.cut_chunk = cut_chunk
        self.step_budget = step_budget
        self._capped = False  # this step's cap cut a chunk (schedule, _chunk)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def worst_case_tokens(self, seq: Sequence) -> int:
        """Tokens the sequence can ever hold: prompt + max_tokens, capped at max_model_len."""
        tokens = seq.num_prompt_tokens + seq.max_tokens
        return tokens if self.max_model_len is None else min(tokens, self.max_model_len)

    def _admissible(self, seq: Sequence) -> bool:
        return self.kv is None or self.kv.can_reserve(seq.request_id, self.worst_case_tokens(seq))

    def _chunk(self, seq: Sequence, budget: int, cap: int = 0) -> int:
        """The tokens ``seq`` computes this step when it prefills: what is left of its
        prompt, at most ``budget``, at most the threshold when it is on and at most this
        step's ``max_mixed_step_ratio`` cap (``cap`` > 0); then ``cut_chunk``, if any."""
        n = min(seq.num_uncomputed, budget)
        for limit in (self.long_prefill_token_threshold, cap):
            n = min(n, limit) if limit > 0 else n
        if cap and n == cap < min(seq.num_uncomputed, budget):
            self._capped = True  # the ratio's cap, not the budget or the threshold, cut it
        return n if self.cut_chunk is None else self.cut_chunk(seq, n)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        # Canonical order as the rows are made: one-token continuations go to the front.
        seqs: list[Sequence] = []
        counts: list[int] = []
        back: list[Sequence] = []
        back_counts: list[int] = []
        for seq in self.running:
            if seq.is_decode and seq.wants_tokens:
                seqs.append(seq)
                counts.append(1)
                budget -= 1
        cap = (self.step_budget.prefill_cap(len(seqs)) if self.step_budget else None) or 0
        self._capped = False
        for seq in self.running:
            if budget == 0:
                break
            if not seq.is_decode and seq.num_uncomputed > 0:
                n = self._chunk(seq, budget, cap)
                if n == 1 and seq.num_computed_tokens > 0:  # a chunk cut to one token
                    seqs.append(seq)
                    counts.append(1)
                else:
                    back.append(seq)
                    back_counts.append(n)
                budget -= n
        while (self.waiting and budget > 0 and self.slots.num_free > 0) and self._admissible(
            self.waiting[0]
        ):
            seq = self.waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            if self.kv is not None:
                self.kv.reserve(seq.request_id, self.worst_case_tokens(seq))
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            n = self._chunk(seq, budget, cap)
            if n == 1 and seq.num_computed_tokens > 0:  # restored to its last prompt token
                seqs.append(seq)
                counts.append(1)
            else:
                back.append(seq)
                back_counts.append(n)
            budget -= n
        batch = ScheduledBatch(
            seqs + back, counts + back_counts, len(seqs), prefill_capped=self._capped
        )
        if self.kv is not None:
            # Within the reservation by construction, so this never runs out of blocks.
            batch.block_tables = [
                self.kv.allocate(s.request_id, s.num_computed_tokens + n)
                for s, n in zip(batch.seqs, batch.num_tokens, strict=True)
            ]
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence, running or waiting; a running one gives its slot, its KV blocks
        and its reservation back now."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.slots.free(seq.slot)
            if self.kv is not None:
                self.kv.free(seq.request_id)  # its blocks and its reservation
        seq.slot = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

"""Prefix caching: which prompt block boundaries get a checkpoint, and when it is written.

``--mamba-cache-mode`` (``EngineConfig.mamba_cache_mode``; docs/prefix_caching.md, "Where
checkpoints are written"):

- ``align``: (a) a prefill chunk that the step's budget (or the long-prefill threshold)
  cuts anyway, and that is not the prompt's last chunk, is rounded down to the block grid
  when the rounded chunk still holds at least one block, and its end is checkpointed: no
  extra step. (b) With ``enable_mamba_shared_prefix_checkpoint``, the *shared-prefix
  junction*: the full-block chain hashes of admitted prompts are remembered (hashes only,
  a bounded LRU); a new prompt's deepest block boundary whose hash was seen before, past
  its restored prefix and short of its end, becomes a target. The second request sharing
  a system prompt cuts one chunk there and writes it; the third and later hit it.
  Both need evidence of reuse unless ``align_cold`` (``enable_mamba_align_cold_checkpoint``,
  default off): (a) only checkpoints a *warm* prompt, one whose first block an earlier
  prompt had (a later chat turn, a shared system prompt from its second request on). A
  checkpoint copies a whole pool line (256 MiB at the Codestral-7B shape) ahead of a
  step's forward, which a prompt nobody sent before most likely never repays (caching on
  cost unique prompts +5% TTFT on the H200: docs/benchmarks/prefix_caching_h200.md, (c)).
- ``all``: a target at every block boundary of the prompt (one step per block: costly).
- ``none``: no Mamba state caching; the engine builds no prefix cache then.

End-of-request checkpoints (``StatePrefixCache.checkpoint``) are written in every mode but
``none``. With ``prompt_end`` (``enable_mamba_prompt_end_checkpoint``) so are *prompt-end*
checkpoints: the state after a whole prompt, keyed by exactly its tokens (a tail key off
the grid), written after the dispatch that computes the prompt's last token (no extra step:
the copy goes ahead of the next forward). A chat's next turn restores it when the answer in
its history does not tokenize back to the ids generated (a template that drops reasoning
text, a random-weight model) and the end-of-request checkpoint cannot match; otherwise the
longer end-of-request one wins. When the request's end-of-request checkpoint is written,
its prompt-end entry goes to the cold end of the LRU, so that it never evicts its own
request's longer checkpoint and is the first to go under pressure.

A *target* is a token count on the grid, below the prompt's length, past the restored
prefix. ``cut`` (the scheduler's chunk hook) ends a prefill chunk exactly on the next
target; after the dispatch, ``after_dispatch`` queues the copy of the sequence's line
into a checkpoint line keyed by the chain hash of the block ending there
(``boundary_hash``), committed at once like an end-of-request checkpoint (its copy goes
with the next step, ahead of its forward). A target whose key is cached already is
skipped. A dispatch that fails never reaches ``after_dispatch`` (the engine drops every
checkpoint then); an aborted request has no more dispatches, so it writes nothing more.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from weakref import WeakKeyDictionary

from vllm.config import MAMBA_CACHE_MODES
from vllm.engine.prefix_cache import StatePrefixCache, boundary_hash, hash_blocks
from vllm.engine.sequence import Sequence

# The most prompt block hashes remembered for the shared-prefix junction (32 bytes each,
# with the LRU's bookkeeping a few MiB at most).
SEEN_PREFIX_BOUND = 65_536


class _Plan:
    """A prefilling sequence's prompt block hashes and its checkpoint targets (ascending)."""

    __slots__ = ("hashes", "targets", "align")

    def __init__(self, hashes: list[bytes], targets: list[int], align: bool):
        self.hashes = hashes
        self.targets = targets
        self.align = align  # align's grid cuts apply (a warm prompt, or align_cold)


class PromptCheckpoints:
    """The prompt-checkpoint policy of one engine core (see the module's docstring)."""

    def __init__(
        self,
        prefix: StatePrefixCache,
        mode: str,
        shared_prefix: bool = True,
        seen_bound: int = SEEN_PREFIX_BOUND,
        prompt_end: bool = False,
        align_cold: bool = False,
    ):
        if mode not in MAMBA_CACHE_MODES or mode == "none":
            raise ValueError(f"mamba_cache_mode must be 'align' or 'all' here, got {mode!r}")
        if isinstance(seen_bound, bool) or not isinstance(seen_bound, int) or seen_bound < 1:
            raise ValueError(f"seen_bound must be an int >= 1, got {seen_bound!r}")
        self.prefix = prefix
        self.block_size = prefix.block_size
        self.mode = mode
        self.shared_prefix = shared_prefix
        self.prompt_end = prompt_end
        self.align_cold = align_cold
        self.seen_bound = seen_bound
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._plans: WeakKeyDictionary[Sequence, _Plan] = WeakKeyDictionary()
        # Counters (tests, logs): chunks ended early on a target or on the grid, and the
        # prompt-boundary checkpoints queued.
        self.num_cuts = 0
        self.num_written = 0
        self.num_cold = 0  # prompts admitted cold, whose align cuts were left out
        self.num_prompt_ends = 0  # prompt-end checkpoints queued
        self._prompt_ends: WeakKeyDictionary[Sequence, bytes] = WeakKeyDictionary()

    # --- targets --------------------------------------------------------------------

    def targets(self, prompt_len: int, hashes: Seq[bytes], restored: int) -> list[int]:
        """The checkpoint targets of a prompt of ``prompt_len`` tokens whose full blocks
        hash to ``hashes`` and whose first ``restored`` tokens were restored. Pure: the
        seen set is read, not updated."""
        bs = self.block_size
        last = (prompt_len - 1) // bs  # the deepest boundary short of the prompt's end
        first = restored // bs + 1  # the first boundary past the restored prefix
        if self.mode == "all":
            found = [b * bs for b in range(first, last + 1)]
        elif self.shared_prefix:
            found = []
            for b in range(last, first - 1, -1):
                if hashes[b - 1] in self._seen:
                    found = [b * bs]
                    break
        else:
            found = []
        return [t for t in found if hashes[t // bs - 1] not in self.prefix.index]

    def _remember(self, hashes: Seq[bytes]) -> None:
        seen = self._seen
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.seen_bound:
            seen.popitem(last=False)

    def admit(self, seq: Sequence, hashes=None) -> None:
        """At admission, after the restore (``num_computed_tokens`` is the restored
        prefix): plan the sequence's targets, then remember its prompt's block hashes
        (``hashes``, when the caller has them)."""
        prompt = seq.prompt_token_ids
        if hashes is None:
            hashes = hash_blocks(prompt, self.block_size)
        warm = bool(hashes) and hashes[0] in self._seen
        align = self.mode == "align" and (warm or self.align_cold)
        self.num_cold += self.mode == "align" and not align and bool(hashes)
        targets = self.targets(len(prompt), hashes, seq.num_computed_tokens)
        self._plans[seq] = _Plan(hashes, targets, align)
        self._remember(hashes)

    # --- the scheduler's hook -------------------------------------------------------

    def cut(self, seq: Sequence, n: int) -> int:
        """The prefill chunk of ``n`` tokens that ``seq`` would compute this step, ended on
        its next target when it would cross it; under ``align``, for a warm prompt (or with
        ``align_cold``), a chunk cut short of the prompt's end anyway is rounded down to the
        grid when a whole block stays in it (that end becomes a target)."""
        plan = self._plans.get(seq)
        start = seq.num_computed_tokens
        if plan is None or start >= seq.num_prompt_tokens:
            return n
        targets, bs = plan.targets, self.block_size
        while targets and (
            targets[0] <= start or plan.hashes[targets[0] // bs - 1] in self.prefix.index
        ):
            targets.pop(0)  # passed, or written since (by another sequence)
        end = start + n
        if targets and targets[0] < end:
            end = targets[0]
            self.num_cuts += 1
        elif plan.align and end < seq.num_prompt_tokens:
            aligned = end - end % bs
            if (aligned == end or aligned - start >= bs) and not (targets and targets[0] == end):
                self.num_cuts += aligned != end
                end = aligned
                targets.insert(0, aligned)
        return end - start

    # --- after a dispatch -----------------------------------------------------------

    def after_dispatch(self, seqs: Seq[Sequence]) -> None:
        """The step is dispatched and ``num_computed_tokens`` advanced: each sequence that
        landed on its next target has its line copied into a checkpoint line (queued for
        the next step, ahead of its forward)."""
        for seq in seqs:
            plan = self._plans.get(seq)
            if plan is None:
                continue
            done = seq.num_computed_tokens
            if plan.targets and plan.targets[0] == done:
                plan.targets.pop(0)
                key = boundary_hash(plan.hashes, done, self.block_size)
                tokens = seq.prompt_token_ids[:done]
                if key is not None and self.prefix.write_prompt(
                    key, seq.slot, tokens, seq.request_id
                ):
                    self.num_written += 1
            if done >= seq.num_prompt_tokens:
                if self.prompt_end and done == seq.num_prompt_tokens:
                    key = self.prefix.write_prompt_end(
                        seq.prompt_token_ids, seq.slot, plan.hashes, seq.request_id
                    )
                    if key is not None:
                        self.num_prompt_ends += 1
                        self._prompt_ends[seq] = key
                del self._plans[seq]  # the prompt is done: no more targets

    def finishing(self, seq: Sequence) -> None:
        """``seq`` finishes (any reason), ahead of its end-of-request checkpoint: its
        prompt-end checkpoint, if it wrote one, becomes the next one evicted."""
        key = self._prompt_ends.pop(seq, None)
        if key is not None:
            self.prefix.index.demote(key)

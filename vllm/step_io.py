"""What the engine and the worker exchange each step: plain host data, no device tensor.

The engine core (``vllm/engine``) flattens its scheduled batch into ``StepInputs`` (with
the ``SamplingMetadata`` of the rows it samples) and hands them to the executor
(``vllm/executor``), which runs them on every rank's worker (``vllm/worker``). Rank 0's
worker returns a ``StepHandle``: the step is queued on the device, and ``get()`` returns
its ``StepOutput`` once that step (and no later one) is done. The engine reads a step's
handle one step later under async scheduling, at once without it.

This module imports nothing of either side, so each side can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class SamplingMetadata:
    """How each sampled row of a step draws its token: one entry per row, in row order.
    ``request_ids[i]`` keys the row's own generator when ``seeds[i]`` is not None (seeded
    rows draw from it, so their tokens do not depend on the batch); ``logprobs[i]`` is how
    many top log-probabilities the row asks for (None: none). ``prompt_targets`` are the
    prompt tokens that the step's prompt-logprob rows predict (one each, in row order), with
    the ``prompt_k`` top log-probabilities at each. ``forget``: request ids whose generators
    (and token counts) are no longer needed (requests that ended since the previous step).

    Logits processing, per row (``SamplingParams``' meaning): the three penalties;
    ``penalty_init`` a list when the row's request samples for the first time with a
    penalty (its output counts start from nothing; for a repetition penalty the list is the
    prompt's ids), None otherwise (the worker has its counts, updated by every token it
    sampled for it); ``banned`` token ids the row cannot draw this step (``min_tokens``
    not reached: the end-of-sequence and stop token ids); ``logit_bias`` {token: bias}."""

    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    logprobs: list[int | None] = field(default_factory=list)
    presence_penalty: list[float] = field(default_factory=list)
    frequency_penalty: list[float] = field(default_factory=list)
    repetition_penalty: list[float] = field(default_factory=list)
    penalty_init: list[list[int] | None] = field(default_factory=list)
    banned: list[list[int]] = field(default_factory=list)
    logit_bias: list[dict[int, float] | None] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_k: int = 0
    forget: list[str] = field(default_factory=list)

    _PER_ROW = ("temperature", "top_k", "top_p", "min_p", "seeds", "request_ids", "logprobs",
                "presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_init",
                "banned", "logit_bias")  # fmt: skip

    @property
    def greedy(self) -> list[bool]:
        return [t == 0.0 for t in self.temperature]

    def __len__(self) -> int:
        return len(self.temperature)

    def row(self, i: int) -> SamplingMetadata:
        """Row ``i`` alone (no prompt rows, nothing to forget): to sample a row apart from
        the others when the batch's sampling failed."""
        return SamplingMetadata(**{f: getattr(self, f)[i : i + 1] for f in self._PER_ROW})


@dataclass
class StepInputs:
    """A step's inputs as flat host lists: per sequence its length this step (``lens``),
    state slot, cached tokens (``contexts``) and, for a model with attention, its block
    table; the first ``num_decodes`` sequences are one-token continuations. Per token its
    id and (attention) position. ``sample_rows``: the token rows whose logits are sampled
    (one per sequence that ends its known tokens). ``fill_dst`` rows take their input token
    from row ``fill_src`` of the previous step's sampled tokens, which the host has not read
    (their id here is a placeholder). ``prompt_rows``: rows whose logits give prompt
    logprobs. ``sampling``: how the sampled rows draw (the engine always gives it;
    ``ModelRunner.execute_inputs``, a bare forward as tools run it, does not read it)."""

    lens: list[int]
    slots: list[int]
    contexts: list[int]
    num_decodes: int
    block_tables: list[list[int]] | None = None
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    fill_dst: list[int] = field(default_factory=list)
    fill_src: list[int] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    sampling: SamplingMetadata | None = None
    # Prefix caching: (src line, dst line) state-pool copies run in order before the forward.
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # Prefix caching of hybrids: (src block, dst block) KV copies in every attention layer,
    # run in order after ``state_copies`` and before the forward (a cached tail block into
    # a restoring sequence's fresh block).
    kv_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class LogprobLists:
    """Log-probabilities read to the host, one entry per row: the row's token (sampled, or
    the prompt's next token), its log-probability and rank, and the row's top-k tokens and
    log-probabilities."""

    token_ids: list[int]
    token_logprobs: list[float]
    ranks: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]

    def position(self, row: int, k: int) -> dict[int, tuple[float, int]]:
        """{token id: (logprob, rank)}: the row's token first, then the ``k`` most likely."""
        out = {self.token_ids[row]: (self.token_logprobs[row], self.ranks[row])}
        top = zip(self.topk_ids[row][:k], self.topk_logprobs[row][:k], strict=True)
        for rank, (tok, lp) in enumerate(top, 1):
            out.setdefault(tok, (lp, rank))
        return out


@dataclass
class StepOutput:
    """A step's results on the host. ``sampled_token_ids[i]`` is the token of sampled row
    i; ``logprobs`` (rows as the sampled rows) when any row asked for them;
    ``prompt_logprobs`` (rows as ``StepInputs.prompt_rows``) when the step had such rows.
    ``errors`` {sampled row: message}: rows whose sampling failed (their token is
    meaningless; the other rows are sampled as usual). ``device_s``: the step's device span,
    from the GPU reaching it to its sampler's end (None off CUDA). ``kernel_compiles``:
    Triton kernel variants the step compiled (a launch that missed the start-up warm-up),
    ``compiles_by_kernel`` naming them. ``graph``: True when the step's forward replayed a
    CUDA graph captured at start-up (a decode-only step, or under cudagraph_mode FULL a
    mixed one within the captured buckets); False when it ran eagerly."""

    sampled_token_ids: list[int]
    logprobs: LogprobLists | None = None
    prompt_logprobs: LogprobLists | None = None
    errors: dict[int, str] = field(default_factory=dict)
    device_s: float | None = None
    kernel_compiles: int = 0
    compiles_by_kernel: dict[str, int] = field(default_factory=dict)
    graph: bool = False


class StepHandle(Protocol):
    """A dispatched step. ``get()`` waits for that step's results only (not for a step
    queued after it) and returns them; a second call returns the same object."""

    def get(self) -> StepOutput: ...

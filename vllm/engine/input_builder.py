"""A scheduled batch -> the step's flat inputs (``vllm.step_io.StepInputs``), which are all
a rank needs of it: the engine builds them once, and the executor sends the same object to
every rank.

Per sequence: the tokens it computes this step, its slot, its cached tokens and (with a KV
cache) its block table. A sequence whose chunk reaches its last known token samples (its
row in ``sample_rows``, its parameters in the ``SamplingMetadata``). A chunk whose last token
is still pending (``PENDING_TOKEN``: sampled by the step before, not read yet) takes it on
the device from that step's sampled tokens, at the row the sequence had there
(``fill_dst``/``fill_src``). A sequence that asks for prompt logprobs has the rows of its
chunk that predict a prompt token in ``prompt_rows``, their targets in the metadata.
A sampled row's logits processing (``_processing``): its penalties, their start with its
first token, and the tokens min_tokens bans while too few are out.
"""

from __future__ import annotations

from vllm.engine.scheduler import ScheduledBatch
from vllm.engine.sequence import PENDING_TOKEN, Sequence
from vllm.step_io import SamplingMetadata, StepInputs


def build_step_inputs(
    batch: ScheduledBatch, forget: list[str]
) -> tuple[StepInputs, list[Sequence], list[tuple[Sequence, int, int]]]:
    """The step's inputs; the sequences of its sampled rows, in row order; and the spans
    (sequence, first position, count) of its prompt-logprob rows, in row order.
    ``forget``: request ids whose sampling generators the worker may drop."""
    inp = StepInputs(
        lens=list(batch.num_tokens),
        slots=[seq.slot for seq in batch.seqs],
        contexts=[seq.num_computed_tokens for seq in batch.seqs],
        num_decodes=batch.num_decodes,
        block_tables=batch.block_tables,
    )
    attention = batch.block_tables is not None
    sampled: list[Sequence] = []
    spans: list[tuple[Sequence, int, int]] = []
    targets: list[int] = []
    prompt_k = 0
    ids = inp.ids
    for seq, n in zip(batch.seqs, inp.lens, strict=True):
        start = seq.num_computed_tokens
        chunk = seq.token_ids[start : start + n]
        count = min(n, seq.num_prompt_tokens - 1 - start)
        if seq.params.prompt_logprobs is not None and count > 0:
            spans.append((seq, start, count))
            inp.prompt_rows.extend(range(len(ids), len(ids) + count))
            targets += seq.prompt_token_ids[start + 1 : start + 1 + count]
            prompt_k = max(prompt_k, seq.params.prompt_logprobs)
        if chunk[-1] == PENDING_TOKEN:
            if PENDING_TOKEN in chunk[:-1]:
                raise RuntimeError(f"{seq}: a pending input token the step cannot fill")
            inp.fill_dst.append(len(ids) + n - 1)
            inp.fill_src.append(seq.pending_row)
        ids.extend(chunk)
        if attention:
            inp.positions.extend(range(start, start + n))
        if start + n == len(seq.token_ids):
            sampled.append(seq)
            inp.sample_rows.append(len(ids) - 1)
    params = [seq.params for seq in sampled]
    processing = [_processing(seq) for seq in sampled]
    inp.sampling = SamplingMetadata(
        temperature=[p.temperature for p in params],
        top_k=[p.top_k for p in params],
        top_p=[p.top_p for p in params],
        min_p=[p.min_p for p in params],
        seeds=[p.seed for p in params],
        request_ids=[seq.request_id for seq in sampled],
        logprobs=[p.logprobs for p in params],
        presence_penalty=[p.presence_penalty for p in params],
        frequency_penalty=[p.frequency_penalty for p in params],
        repetition_penalty=[p.repetition_penalty for p in params],
        penalty_init=[init for init, _ in processing],
        banned=[banned for _, banned in processing],
        logit_bias=[p.logit_bias for p in params],
        prompt_targets=targets,
        prompt_k=prompt_k,
        forget=forget,
    )
    return inp, sampled, spans


def _processing(seq: Sequence) -> tuple[list[int] | None, list[int]]:
    """(penalty_init, banned) of the row ``seq`` samples now. The tokens out so far count
    the one still pending (it is in ``token_ids``)."""
    p = seq.params
    out = len(seq.token_ids) - seq.num_prompt_tokens
    init = None
    if p.has_penalties and out == 0:
        init = list(seq.prompt_token_ids) if p.repetition_penalty != 1.0 else []
    banned: list[int] = []
    if out < p.min_tokens:
        banned = list(p.stop_token_ids)
        if not p.ignore_eos and seq.eos_token_id is not None:
            banned.append(seq.eos_token_id)
    return init, banned

"""Logits processing ahead of sampling (rank 0, on the device, no host sync): min_tokens'
bans, logit_bias, and the repetition, frequency and presence penalties, in vLLM's order.

The penalties need each request's output token counts (and for the repetition penalty, the
set of its prompt's tokens). The host does not have the newest of them under async
scheduling (a token sampled by the step in flight), so the counts live here, on the
device: one row of a pooled (rows, vocab) int32 table per request with a penalty, started
when its first token is sampled (``penalty_init``), and bumped by every token the sampler
draws for it, right after the draw, in stream order. A request's row is freed when the
engine says it ended (``forget``). The pool grows by doubling; at a 128k vocabulary a row
is 512 KiB (640 KiB with the prompt's set), so 64 penalised requests take 40 MiB.

The processed logits are a copy: the log-probabilities a request asks for are of the
model's logits (vLLM's default, ``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm.step_io import SamplingMetadata
from vllm.worker.utils import async_tensor_h2d


def _column(md: SamplingMetadata, name: str, default) -> list:
    """``md``'s per-row list ``name``, or ``default`` for every row where a caller built
    the metadata without it (tools, tests)."""
    values = getattr(md, name)
    return values if len(values) == len(md) else [default] * len(md)


def _penalised(md: SamplingMetadata) -> list[int]:
    pres = _column(md, "presence_penalty", 0.0)
    freq = _column(md, "frequency_penalty", 0.0)
    rep = _column(md, "repetition_penalty", 1.0)
    return [i for i in range(len(md)) if pres[i] != 0.0 or freq[i] != 0.0 or rep[i] != 1.0]


class TokenCounts:
    """Each penalised request's output token counts and prompt token set, on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.counts: torch.Tensor | None = None  # (capacity, vocab) int32
        self.prompt: torch.Tensor | None = None  # (capacity, vocab) bool
        self.rows: dict[str, int] = {}
        self.free: list[int] = []

    def _row(self, request_id: str, vocab: int) -> int:
        row = self.rows.get(request_id)
        if row is not None:
            return row
        if not self.free:
            old = 0 if self.counts is None else self.counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros(new, vocab, dtype=torch.int32, device=self.device)
            prompt = torch.zeros(new, vocab, dtype=torch.bool, device=self.device)
            if old:
                counts[:old], prompt[:old] = self.counts, self.prompt
            self.counts, self.prompt = counts, prompt
            self.free = list(range(new - 1, old - 1, -1))
        row = self.free.pop()
        self.rows[request_id] = row
        return row

    def rows_of(self, md: SamplingMetadata, which: list[int], vocab: int) -> torch.Tensor:
        """The pool rows of ``which`` (sampled rows of ``md``), started first where
        ``penalty_init`` says so."""
        inits = _column(md, "penalty_init", None)
        rows = []
        for i in which:
            rid = md.request_ids[i]
            if inits[i] is None and rid not in self.rows:
                raise RuntimeError(f"request {rid}: a penalty without token counts on this rank")
            row = self._row(rid, vocab)
            if inits[i] is not None:
                self.counts[row].zero_()
                self.prompt[row].zero_()
                if inits[i]:
                    ids = async_tensor_h2d(inits[i], self.device)
                    self.prompt[row].index_fill_(0, ids, True)
            rows.append(row)
        return async_tensor_h2d(rows, self.device)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the tokens just drawn (``tokens[j]`` for pool row ``rows[j]``)."""
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.free.append(row)


def process(logits: torch.Tensor, md: SamplingMetadata, counts: TokenCounts):
    """The processed logits (a copy; ``logits`` itself when no row asks for anything) and
    the pool rows of the penalised sampled rows with their indices (for ``record``)."""
    banned = _column(md, "banned", [])
    bias = _column(md, "logit_bias", None)
    which = _penalised(md)
    if not which and not any(banned) and not any(bias):
        return logits, None
    dev, vocab = logits.device, logits.shape[1]
    out = logits.clone()
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < vocab]
    if pairs:
        r = async_tensor_h2d([p[0] for p in pairs], dev)
        t = async_tensor_h2d([p[1] for p in pairs], dev)
        out.index_put_((r, t), torch.full_like(r, float("-inf"), dtype=out.dtype))
    triples = [(i, t, v) for i, b in enumerate(bias) if b for t, v in b.items()]
    if triples:
        r = async_tensor_h2d([x[0] for x in triples], dev)
        t = async_tensor_h2d([x[1] for x in triples], dev)
        v = async_tensor_h2d([x[2] for x in triples], dev).to(out.dtype)
        out.index_put_((r, t), v, accumulate=True)
    if not which:
        return out, None
    rows = counts.rows_of(md, which, vocab)
    idx = async_tensor_h2d(which, dev)
    sub = out.index_select(0, idx)
    n = counts.counts.index_select(0, rows)
    in_output = n > 0

    def column(name: str, default: float) -> torch.Tensor:  # (penalised rows, 1)
        values = [_column(md, name, default)[i] for i in which]
        return async_tensor_h2d(values, dev).to(sub.dtype)[:, None]

    rep = column("repetition_penalty", 1.0)
    seen = in_output | counts.prompt.index_select(0, rows)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - column("frequency_penalty", 0.0) * n.to(sub.dtype)
    sub = sub - column("presence_penalty", 0.0) * in_output.to(sub.dtype)
    out.index_copy_(0, idx, sub)
    return out, (rows, idx)

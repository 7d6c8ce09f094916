"""Sampler: next tokens from the last-token logits of a step, all rows at once.

Greedy rows (temperature 0) take the argmax. The others are scaled by 1/temperature,
filtered by top-k then top-p, and drawn with the exponential race (argmax of p / E with
E ~ Exp(1), which picks token i with probability p_i): no host sync, and a request with a
``seed`` draws its E from its own generator, so its tokens do not depend on the batch.
``compute_logprobs`` gives the log-probabilities that ``logprobs`` and ``prompt_logprobs``
ask for, on the device too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.engine.sequence import Sequence


def _small(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A small host list on ``device`` without a host sync (``torch.tensor(..., device=cuda)``
    waits for the stream's queued work, which would stall async scheduling)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seq_generators: dict[str, torch.Generator] = {}

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        gen = self._seq_generators.get(seq.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._seq_generators[seq.request_id] = gen
        return gen

    def forget(self, seq: Sequence) -> None:
        self._seq_generators.pop(seq.request_id, None)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits`` (len(seqs), vocab) fp32 -> one token id per row, as an int64 tensor on
        the logits' device, without a host sync."""
        params = [s.params for s in seqs]
        greedy = logits.argmax(-1)
        if all(p.greedy for p in params):
            return greedy
        dev = logits.device
        temp = _small([p.temperature or 1.0 for p in params], dev)
        scaled = logits / temp[:, None]
        if any(0 < p.top_k < logits.shape[1] or p.top_p < 1.0 for p in params):
            scaled = self._top_k_top_p(scaled, params)
        probs = scaled.softmax(-1)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            gen = self._generator(seq)
            if gen is not None and not seq.params.greedy:
                race[i].exponential_(generator=gen)
        sampled = (probs / race).argmax(-1)
        is_greedy = _small([p.greedy for p in params], dev)
        return torch.where(is_greedy, greedy, sampled)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
        vocab = logits.shape[1]
        dev = logits.device
        k = _small([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dev)
        top_p = _small([p.top_p for p in params], dev)
        sorted_logits, order = logits.sort(-1, descending=True)
        rank = torch.arange(vocab, device=dev)
        drop = rank[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # before it already does (the top token always stays).
        mass_before = probs.cumsum(-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


@dataclass
class LogprobLists:
    """``SampledLogprobs`` read to the host."""

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
class SampledLogprobs:
    """Device tensors: each row's token (sampled, or the prompt's next token), its
    log-probability and rank, and the row's top-k tokens and log-probabilities."""

    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    ranks: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor

    NUM_TENSORS = 5

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in order (``SampledLogprobs(*tensors)`` rebuilds it, e.g. from host
        copies)."""
        return (self.token_ids, self.token_logprobs, self.ranks, self.topk_ids, self.topk_logprobs)

    def to_lists(self) -> LogprobLists:
        return LogprobLists(
            self.token_ids.tolist(),
            self.token_logprobs.tolist(),
            self.ranks.tolist(),
            self.topk_ids.tolist(),
            self.topk_logprobs.tolist(),
        )


@torch.no_grad()
def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], k: int
) -> SampledLogprobs:
    """Log-probabilities of the raw logits (before temperature and top-k/top-p, as vLLM
    reports them) for ``token_ids`` (one per row) and each row's ``k`` best; no host sync."""
    if not isinstance(token_ids, torch.Tensor):
        token_ids = _small(token_ids, logits.device, dtype=torch.long)
    logp = logits.float().log_softmax(-1)
    token_lp = logp.gather(1, token_ids[:, None])[:, 0]
    # Rank 1 is the most likely token; ties share the better rank.
    ranks = (logp > token_lp[:, None]).sum(-1) + 1
    top_lp, top_ids = logp.topk(min(k, logp.shape[1]), dim=-1)
    return SampledLogprobs(token_ids, token_lp, ranks, top_ids, top_lp)

"""Sampler: next tokens from the last-token logits of a step, all rows at once.

The logits are first processed where a row asks for it (min_tokens' bans, logit_bias and
the penalties: ``logits_processors.py``). Greedy rows (temperature 0) take the argmax.
The others are scaled by 1/temperature, filtered by min-p (tokens less likely than min_p
times the row's most likely one), then top-k, then top-p (vLLM's order), and drawn with
the exponential race (argmax of p / E with E ~ Exp(1), which picks token i with
probability p_i): no host sync, and a request with a ``seed`` draws its E from its own
generator (kept by request id until the engine says the request ended), so its tokens do
not depend on the batch. ``compute_logprobs`` gives the log-probabilities that
``logprobs`` and ``prompt_logprobs`` ask for, on the device too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from vllm.step_io import LogprobLists, SamplingMetadata
from vllm.worker.logits_processors import TokenCounts, process
from vllm.worker.utils import async_tensor_h2d


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seq_generators: dict[str, torch.Generator] = {}
        self.token_counts = TokenCounts(self.device)  # the penalties' (logits_processors.py)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._seq_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._seq_generators[request_id] = gen
        return gen

    def forget(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for rid in request_ids:
            self._seq_generators.pop(rid, None)
        self.token_counts.forget(request_ids)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """``logits`` (len(md), vocab) fp32 -> one token id per row, as an int64 tensor on
        the logits' device, without a host sync. The logits are processed first (bans,
        bias, penalties: ``logits_processors.py``); the penalised rows' tokens are counted."""
        logits, penalised = process(logits, md, self.token_counts)
        tokens = self._draw(logits, md)
        if penalised is not None:
            rows, idx = penalised
            self.token_counts.record(rows, tokens.index_select(0, idx))
        return tokens

    def _draw(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(-1)
        is_greedy = md.greedy
        if all(is_greedy):
            return greedy
        dev = logits.device
        temp = async_tensor_h2d([t or 1.0 for t in md.temperature], dev)
        scaled = logits / temp[:, None]
        vocab = logits.shape[1]
        if any(p > 0.0 for p in md.min_p):
            scaled = self._min_p(scaled, md.min_p)
        if any(0 < k < vocab for k in md.top_k) or any(p < 1.0 for p in md.top_p):
            scaled = self._top_k_top_p(scaled, md.top_k, md.top_p)
        probs = scaled.softmax(-1)
        race = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, (seed, rid) in enumerate(zip(md.seeds, md.request_ids, strict=True)):
            if seed is not None and not is_greedy[i]:
                race[i].exponential_(generator=self._generator(rid, seed))
        sampled = (probs / race).argmax(-1)
        return torch.where(async_tensor_h2d(is_greedy, dev), greedy, sampled)

    @staticmethod
    def _min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
        """-inf where a token's probability is below min_p times its row's highest (a row
        with min_p 0 keeps every token; the most likely token always stays)."""
        probs = logits.softmax(-1)
        floor = async_tensor_h2d(min_p, logits.device)[:, None] * probs.amax(-1, keepdim=True)
        return logits.masked_fill(probs < floor, float("-inf"))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        vocab = logits.shape[1]
        dev = logits.device
        k = async_tensor_h2d([n if 0 < n < vocab else vocab for n in top_k], dev)
        p = async_tensor_h2d(top_p, dev)
        sorted_logits, order = logits.sort(-1, descending=True)
        rank = torch.arange(vocab, device=dev)
        drop = rank[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass
        # before it already does (the top token always stays).
        mass_before = probs.cumsum(-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= p[:, None], float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


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
        return LogprobLists(*(t.tolist() for t in self.tensors()))


@torch.no_grad()
def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | list[int], k: int
) -> SampledLogprobs:
    """Log-probabilities of the raw logits (before temperature and top-k/top-p, as vLLM
    reports them) for ``token_ids`` (one per row) and each row's ``k`` best; no host sync."""
    if not isinstance(token_ids, torch.Tensor):
        token_ids = async_tensor_h2d(token_ids, logits.device, dtype=torch.long)
    logp = logits.float().log_softmax(-1)
    token_lp = logp.gather(1, token_ids[:, None])[:, 0]
    # Rank 1 is the most likely token; ties share the better rank.
    ranks = (logp > token_lp[:, None]).sum(-1) + 1
    top_lp, top_ids = logp.topk(min(k, logp.shape[1]), dim=-1)
    return SampledLogprobs(token_ids, token_lp, ranks, top_ids, top_lp)

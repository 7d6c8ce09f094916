"""LLMEngine: requests in, one scheduled mixed batch per ``step``, finished outputs out.

A step: the scheduler picks the batch, the runner computes the logits of the rows that end
a sequence's known tokens, the sampler draws one token for each, and each of those
sequences takes its token, its new text, and may finish (EOS, a stop string, max_tokens),
which frees its slot.

Async scheduling (``EngineConfig.async_scheduling``, on by default, as vLLM's
``--async-scheduling``): a step is dispatched before the host has read the previous
step's tokens. Its decode rows take their input tokens on the device from the previous
step's sampled tokens (``PENDING_TOKEN`` stands for them on the host), and only then does
the host read the previous step's tokens, detokenize and check stops, while the GPU runs
the new step: the host's per-step work hides behind the GPU's. A sequence that a stop
string or EOS ends has been dispatched in one more step by then; that step's token for it
is dropped, so outputs are the same as without async scheduling. ``max_tokens`` is known
ahead, so no step is wasted on it. ``step`` returns what finished in the step it read.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from vllm.engine.config import EngineConfig
from vllm.engine.sampler import Sampler
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import PENDING_TOKEN, Sequence
from vllm.engine.tokenizer import IncrementalDetokenizer, get_tokenizer
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


@dataclass
class _Dispatched:
    """A step whose sampled tokens are still on the device: ``tokens[i]`` is the token of
    ``seqs[i]``, to go at ``positions[i]`` of its token list."""

    seqs: list[Sequence]
    positions: list[int]
    tokens: torch.Tensor


class LLMEngine:
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.config = config
        self.runner = ModelRunner(config)
        self.tokenizer = get_tokenizer(config.tokenizer, self.runner.model.config.vocab_size)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(self.runner.device, config.seed)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._counter = itertools.count()
        self.num_steps = 0
        self._in_flight: _Dispatched | None = None
        self.startup = {**self.runner.startup, "total_s": time.perf_counter() - t0}
        logger.info(startup_line(self.startup))

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> Sequence:
        arrival = next(self._counter)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        seq = Sequence(request_id or str(arrival), ids, params, prompt=text, arrival=arrival)
        self._detok[seq.request_id] = IncrementalDetokenizer(self.tokenizer, ids)
        self.scheduler.add(seq)
        return seq

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that finished (in the step whose
        tokens this call read: the one before, under async scheduling)."""
        batch = self.scheduler.schedule()
        dispatched = self._dispatch(batch) if batch.seqs else None
        if dispatched is None and self._in_flight is None and self.scheduler.running:
            raise RuntimeError(f"running sequences with nothing to compute: {batch}")
        finished = []
        if self._in_flight is not None:
            finished = self._read(self._in_flight)
        self._in_flight = dispatched
        if dispatched is not None and not self.config.async_scheduling:
            finished += self._read(dispatched)
            self._in_flight = None
        return finished

    def _dispatch(self, batch) -> _Dispatched:
        """Queue the step on the device: model, sampler; the tokens stay there."""
        prev = self._in_flight.tokens if self._in_flight is not None else None
        logits, sampled_idx = self.runner.execute(batch, prev)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
        seqs = [batch.seqs[i] for i in sampled_idx]
        tokens = self.sampler.sample(logits, seqs) if seqs else logits.new_empty(0).long()
        positions = []
        for row, seq in enumerate(seqs):
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending_row = row
        self.num_steps += 1
        return _Dispatched(seqs, positions, tokens)

    def _read(self, step: _Dispatched) -> list[RequestOutput]:
        """Read a dispatched step's tokens (waits for that step only) and apply them."""
        finished = []
        for seq, pos, token in zip(step.seqs, step.positions, step.tokens.tolist(), strict=True):
            if seq.is_finished:
                continue  # ended by an earlier step's token: this one is dropped
            seq.token_ids[pos] = token
            reason = self._check_stop(seq, pos)
            if reason is not None:
                del seq.token_ids[pos + 1 :]  # a later step's pending token
                self.scheduler.finish(seq, reason)
                self.sampler.forget(seq)
                del self._detok[seq.request_id]
                finished.append(self.output_of(seq))
        return finished

    def _check_stop(self, seq: Sequence, pos: int) -> str | None:
        """Whether the token at ``pos`` (the last one read) ends the sequence, and why."""
        params = seq.params
        token = seq.token_ids[pos]
        delta = self._detok[seq.request_id].step(seq.token_ids, pos + 1)
        if delta:
            seq.output_text += delta
            if params.stop_strings:
                # Only the tail can hold a stop string that this token completed.
                longest = max(map(len, params.stop_strings))
                tail_from = max(0, len(seq.output_text) - len(delta) - longest + 1)
                hits = [
                    i for s in params.stop_strings if (i := seq.output_text.find(s, tail_from)) >= 0
                ]
                if hits:
                    seq.output_text = seq.output_text[: min(hits)]
                    return "stop"
        eos = self.tokenizer.eos_token_id
        if not params.ignore_eos and eos is not None and token == eos:
            return "stop"
        if pos + 1 - seq.num_prompt_tokens >= params.max_tokens:
            return "length"
        return None

    @staticmethod
    def output_of(seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
        )


def startup_line(s: dict) -> str:
    """The start-up log line: the total and its parts."""
    return (
        f"engine start-up {s['total_s']:.1f} s: weights {s['weights_s']:.1f} s, state pool "
        f"{s['state_pool_s']:.1f} s ({s['state_pool_gib']:.2f} GiB), kernel compile "
        f"{s['compile_s']:.1f} s ({s['num_kernels']} variants, {s['num_kernels_compiled']} new) "
        f"in a warm-up of "
        f"{s['warmup_s']:.1f} s, graph capture {s['graph_capture_s']:.1f} s "
        f"({s['num_graphs']} graphs)"
    )

"""LLMEngine: requests in, one scheduled mixed batch per ``step``, finished outputs out.

A step: the scheduler picks the batch, the runner computes the logits of the rows that end
a sequence's known tokens, the sampler draws one token for each, and each of those
sequences takes its token, its new text, and may finish (EOS, a stop string, max_tokens),
which frees its slot before the next step.
"""

from __future__ import annotations

import itertools
import time

from vllm.engine.config import EngineConfig
from vllm.engine.sampler import Sampler
from vllm.engine.scheduler import Scheduler
from vllm.engine.sequence import Sequence
from vllm.engine.tokenizer import IncrementalDetokenizer, get_tokenizer
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


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
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that finished in it."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            if self.scheduler.running:
                raise RuntimeError(f"running sequences with nothing to compute: {batch}")
            return []
        logits, sampled_idx = self.runner.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
        sampled = [batch.seqs[i] for i in sampled_idx]
        tokens = self.sampler(logits, sampled) if sampled else []
        finished = []
        for seq, token in zip(sampled, tokens, strict=True):
            seq.token_ids.append(token)
            reason = self._check_stop(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self.sampler.forget(seq)
                del self._detok[seq.request_id]
                finished.append(self.output_of(seq))
        self.num_steps += 1
        return finished

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        delta = self._detok[seq.request_id].step(seq.token_ids)
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
        if len(seq.output_token_ids) >= params.max_tokens:
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

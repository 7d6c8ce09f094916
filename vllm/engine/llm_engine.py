"""LLMEngine: the synchronous face of the engine core (``LLM`` drives it).

``add_request`` checks and tokenizes a request (``processor.py``) and hands it, one core
request per sample, to the ``EngineCore``; ``step`` runs one core step and returns the
``RequestOutput`` of every request that has something new (``output_processor.py``: text,
stop strings, logprobs, the merge of ``n`` samples, the output kind); ``abort_request``
ends requests and frees their slots at once. A request that fails while running (sampling,
detokenizing) comes back finished with reason "error" and its message in ``errors``; the
other requests and the engine go on. ``step_totals`` sums every step's ``StepStats`` (host
timing and token counts: ``stats.py``) from the engine's start.

``client_class`` builds ``self.core``, the engine-core client (``core_client.py``):
``InprocClient`` (the default: the core in this process, a step run per ``step`` call) or
``MPClient`` (``core_proc.py``: the core in a process of its own). ``AsyncLLM`` is the
sibling over the same parts for the server. ``engine_core`` is the in-process
``EngineCore``, and ``runner`` rank 0's model runner through its executor: for tools and
tests.
"""

from __future__ import annotations

import time

from vllm.config import EngineConfig
from vllm.engine.core import EngineCore
from vllm.engine.core_client import EngineCoreClient, InprocClient
from vllm.engine.output_processor import OutputProcessor
from vllm.engine.processor import InputProcessor, ProcessedPrompt
from vllm.engine.stats import IterationStats, StepTotals, startup_line
from vllm.engine.tokenizer import get_tokenizer
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, client_class: type[EngineCoreClient] = InprocClient):
        t0 = time.perf_counter()
        self.config = config
        self.core = client_class(config)
        vocab = self.core.vocab_size
        self.tokenizer = get_tokenizer(config.tokenizer_dir, vocab)
        self.processor = InputProcessor(config, self.tokenizer, vocab)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Requests that failed while running: {request id: message}, until read.
        self.errors: dict[str, str] = {}
        self.step_totals = StepTotals()
        self.startup = {**self.core.startup, "total_s": time.perf_counter() - t0}
        logger.info(startup_line(self.startup))

    @classmethod
    def from_engine_args(cls, args) -> LLMEngine:
        return cls(args.create_engine_config())

    # The in-process core's parts, where benchmarks and tests look for them.
    @property
    def engine_core(self) -> EngineCore:
        if not self.core.in_process:
            raise RuntimeError("the engine core runs in a process of its own")
        return self.core.engine_core

    @property
    def runner(self):
        """Rank 0's ``ModelRunner`` (the worker in this process)."""
        return self.engine_core.executor.driver_worker.runner

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def model_config(self):
        """vLLM's ``llm_engine.model_config`` (lm-eval reads its ``max_model_len``): the
        EngineConfig, which holds those fields here."""
        return self.config

    @property
    def num_steps(self) -> int:
        return self.engine_core.num_steps

    def process(self, prompt, params: SamplingParams) -> ProcessedPrompt:
        """Check and tokenize one request (ValueError naming the problem); queues nothing."""
        return self.processor.process(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Check, then queue, one request; nothing is queued when it raises."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.add_processed(request_id, self.process(prompt, params), params, arrival_time)

    def add_processed(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        for req in self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, params, arrival_time
        ):
            self.core.add_request(req)

    def abort_request(
        self, request_ids: str | list[str], stats: IterationStats | None = None
    ) -> None:
        """End these requests now and free their slots (unknown ids are ignored); each one
        counts in ``stats`` as finished by "abort"."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.abort(rid, stats))

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests) or self.core.has_unfinished_requests()

    def step(self, stats: IterationStats | None = None) -> list[RequestOutput]:
        """One core step; the outputs of the requests with something new (and of those
        that failed: finished, reason "error", the message in ``self.errors``)."""
        result = self.core.get_output()
        if result is None:
            return []
        outputs, to_abort, errors = self.output_processor.process_step(
            result, stats, self.core.in_process
        )
        if to_abort:
            self.core.abort_requests(to_abort)
        self.errors.update(errors)
        if result.step is not None:
            self.step_totals.add(result.step)
        if stats is not None:
            stats.num_running = self.core.num_running
            stats.num_waiting = self.core.num_waiting
        return outputs

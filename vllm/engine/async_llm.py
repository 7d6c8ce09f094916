"""AsyncLLM: the asyncio face of the engine, for the server.

One background thread drives the engine: it takes the requests and aborts queued since
its last step, runs a step, and hands each request's outputs to that request's asyncio
queue (``loop.call_soon_threadsafe``). The event loop never waits for the GPU, so the
server accepts connections and streams while steps run. Each record to the stat loggers
carries the step's timing (``IterationStats.step``) and the loop's time since the previous
record outside the step: waiting for work, and the rest (``loop_wait_s``, ``loop_other_s``).

``add_request`` checks the request in the caller's thread before anything is queued (a
ValueError names the problem) and returns a ``RequestStream``; ``generate`` wraps it in an
async generator whose closing (a client gone: the task cancelled, or the generator
closed) aborts the request, which frees its slot in the next step.

A request that fails while running raises ``RequestFailedError`` from its stream; the
others go on. Should the loop itself die (a bug, a device fault), every stream raises
``EngineDeadError``, ``errored`` turns True and new requests are refused.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator

from vllm.engine.config import EngineConfig
from vllm.engine.llm_engine import LLMEngine
from vllm.engine.processor import ProcessedPrompt
from vllm.engine.stats import IterationStats, StatLoggerBase
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can run any more."""


class RequestFailedError(RuntimeError):
    """This request failed while running (the others were not affected)."""


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLoggerBase] | None = None):
        self.config = config
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.stat_loggers = list(stat_loggers or [])
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[str, str, ProcessedPrompt | None, SamplingParams | None, float]]
        self._inbox = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errored = False
        self.dead_error: BaseException | None = None
        self.num_requests_running = 0
        self.num_requests_waiting = 0

    @classmethod
    def from_engine_args(cls, args, stat_loggers=None) -> AsyncLLM:
        return cls(args.create_engine_config(), stat_loggers)

    # -- requests (event loop thread) ------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        """Check and queue one request; its stream of outputs. Nothing is queued when it
        raises (ValueError: a bad request; EngineDeadError: the engine is gone)."""
        if self.errored:
            raise EngineDeadError(f"the engine loop died: {self.dead_error}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        processed = self.engine.process(prompt, params)
        self._ensure_loop()
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        with self._wake:
            self._inbox.append(("add", request_id, processed, params, time.monotonic()))
            self._wake.notify()
        return stream

    async def generate(
        self, prompt, sampling_params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs; leaving early (a disconnect) aborts it."""
        stream = self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        with self._wake:
            self._inbox.append(("abort", request_id, None, None, 0.0))
            self._wake.notify()

    async def shutdown(self) -> None:
        """Abort what runs, stop the loop thread and wait for it, then the core (its
        tensor-parallel workers)."""
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(EngineDeadError("the engine is shutting down"))
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self.engine.core.shutdown()  # the tensor-parallel workers, if any

    def _ensure_loop(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    # -- the engine loop (its own thread) -------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        clock = time.perf_counter
        try:
            last_record = clock()
            while True:
                t_wait = clock()
                with self._wake:
                    while not self._inbox and not self._stopping:
                        if engine.has_unfinished_requests():
                            break
                        self._wake.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                stats = IterationStats(loop_wait_s=clock() - t_wait)
                for op, rid, processed, params, arrival in inbox:
                    if op == "add":
                        engine.add_processed(rid, processed, params, arrival)
                    else:
                        engine.abort_request(rid, stats)
                outputs = []
                if engine.has_unfinished_requests():
                    outputs = engine.step(stats)
                self.num_requests_running = stats.num_running = engine.core.num_running
                self.num_requests_waiting = stats.num_waiting = engine.core.num_waiting
                # The loop's time since its last record, less the wait and the step.
                now, step = clock(), stats.step
                stats.loop_other_s = max(
                    0.0, now - last_record - stats.loop_wait_s - (step.total_s if step else 0.0)
                )
                last_record = now
                # Counted before the outputs go out: a client that has its last token and
                # then reads /metrics sees its request in them.
                for stat_logger in self.stat_loggers:
                    stat_logger.record(stats)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs, dict(engine.errors))
                    engine.errors.clear()
        except BaseException as err:  # noqa: BLE001 - every stream must hear of it
            logger.exception("the engine loop died")
            self.errored, self.dead_error = True, err
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, err)
        finally:
            self._abort_all()

    def _abort_all(self) -> None:
        """Leave no slot taken when the loop ends."""
        try:
            engine = self.engine
            for rid in list(engine.output_processor.requests):
                engine.abort_request(rid)
        except Exception:  # noqa: BLE001 - already on the way out
            logger.exception("aborting the requests left at shutdown failed")

    # -- back on the event loop -------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput], errors: dict[str, str]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.request_id in errors:
                stream.put(RequestFailedError(errors[out.request_id]))
            else:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self._streams):
            self._streams.pop(rid).put(EngineDeadError(f"the engine loop died: {err}"))

"""AsyncLLM: the asyncio face of the engine, for the server.

``LLMEngine``'s sibling: it owns the same parts (an ``InputProcessor``, an
``OutputProcessor``, an engine-core client) and drives them from one background thread, so
the event loop never waits for the GPU and the server accepts connections and streams
while steps run. ``engine_process`` (default: ``VLLM_ENABLE_V1_MULTIPROCESSING``, on) picks
the client: ``MPClient`` (``core_proc.py``: the core's steps run in a process of their own,
back to back, and never wait for the GIL that the event loop holds while it streams) or
``InprocClient`` (the core steps on the loop's thread).

The loop is the same over both. Each pass it takes the requests and aborts that the event
loop queued since the last pass, hands them to the output processor and the client, and
asks the client for the next outputs (``wait_for_output``: a step in process, the core
process's next result otherwise). Queueing pokes the client, which ends that wait at once
(it returns None) so the loop takes the new work first. Each result goes through the
output processor and then out: the stat loggers get the ``IterationStats`` (the step's
timing in ``step``, and ``loop_wait_s`` / ``loop_other_s``: the time of the loop that steps
the core outside its steps, waiting for work and the rest), then each request's outputs
go to its asyncio queue (``loop.call_soon_threadsafe``).

``add_request`` checks the request in the caller's thread before anything is queued (a
ValueError names the problem) and returns a ``RequestStream``; ``generate`` wraps it in an
async generator whose closing (a client gone: the task cancelled, or the generator
closed) aborts the request, which frees its slot in the next step.

A request that fails while running raises ``RequestFailedError`` from its stream; the
others go on. Should the loop itself die (a bug, a device fault, a core process that
died), every stream raises ``EngineDeadError``, ``errored`` turns True and new requests are
refused.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator

from vllm import envs
from vllm.config import EngineConfig
from vllm.engine.core_client import EngineCoreClient, InprocClient
from vllm.engine.core_proc import MPClient
from vllm.engine.output_processor import OutputProcessor
from vllm.engine.processor import InputProcessor, ProcessedPrompt
from vllm.engine.stats import IterationStats, StatLoggerBase, startup_line
from vllm.engine.tokenizer import get_tokenizer
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
    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: list[StatLoggerBase] | None = None,
        engine_process: bool | None = None,
    ):
        t0 = time.perf_counter()
        self.config = config
        if engine_process is None:
            engine_process = envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self.engine_process = engine_process
        client_class = MPClient if engine_process else InprocClient
        self.core: EngineCoreClient = client_class(config)
        vocab = self.core.vocab_size
        self.tokenizer = get_tokenizer(config.tokenizer_dir, vocab)
        self.processor = InputProcessor(config, self.tokenizer, vocab)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup = {**self.core.startup, "total_s": time.perf_counter() - t0}
        logger.info(startup_line(self.startup))
        self.stat_loggers = list(stat_loggers or [])
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._inbox: list[tuple[str, str, ProcessedPrompt | None, SamplingParams | None, float]]
        self._inbox = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._shut_down = False
        self.errored = False
        self.dead_error: BaseException | None = None
        self.num_requests_running = 0
        self.num_requests_waiting = 0

    @classmethod
    def from_engine_args(cls, args, stat_loggers=None, engine_process=None) -> AsyncLLM:
        return cls(args.create_engine_config(), stat_loggers, engine_process)

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
        processed = self.processor.process(prompt, params)
        self._ensure_loop()
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._queue(("add", request_id, processed, params, time.monotonic()))
        return stream

    def _queue(self, item) -> None:
        with self._lock:
            # One poke per batch the loop takes: the ones after it would only wake it to
            # find its inbox empty.
            poke = not self._inbox
            self._inbox.append(item)
        if poke:
            self.core.poke()

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
        self._queue(("abort", request_id, None, None, 0.0))

    async def shutdown(self) -> None:
        """Abort what runs, stop the loop thread and wait for it, and the core with it (its
        process, its tensor-parallel workers). A second call does nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(EngineDeadError("the engine is shutting down"))
        with self._lock:
            self._stopping = True
        self.core.poke()
        # The loop shuts the client down as it ends; without a loop, nothing else will.
        wait = self._thread.join if self._thread is not None else self.core.shutdown
        await asyncio.get_running_loop().run_in_executor(None, wait)

    def _ensure_loop(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()

    # -- the engine loop (its own thread) -------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                stats = IterationStats()
                self._take(inbox, stats)
                if stats.finished:
                    # Aborts count now: the core may have nothing left to step.
                    self._publish(stats, [])
                    stats = IterationStats()
                result = core.wait_for_output()
                if result is None:
                    continue  # poked: take what was queued, then ask again
                stats.loop_wait_s = result.loop_wait_s
                stats.loop_other_s = result.loop_other_s
                stats.late_wait_s, stats.late_arrivals = result.late_wait_s, result.late_arrivals
                outputs, to_abort, _ = self.output_processor.process_step(
                    result, stats, core.in_process
                )
                if to_abort:
                    core.abort_requests(to_abort)
                self._publish(stats, outputs)
        except BaseException as err:  # noqa: BLE001 - every stream must hear of it
            self._died(err)
        finally:
            self._abort_all()
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - already on the way out
                logger.exception("shutting the engine core down failed")

    def _take(self, inbox: list, stats: IterationStats) -> None:
        """Hand the queued requests and aborts to the output processor and the core."""
        for op, rid, processed, params, arrival in inbox:
            if op == "add":
                for req in self.output_processor.add_request(
                    rid, processed.prompt, processed.prompt_token_ids, params, arrival
                ):
                    self.core.add_request(req)
            else:
                self.core.abort_requests(self.output_processor.abort(rid, stats))

    def _died(self, err: BaseException) -> None:
        logger.exception("the engine loop died")
        self.errored, self.dead_error = True, err
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, err)

    def _publish(self, stats: IterationStats, outputs: list[RequestOutput]) -> None:
        """Record the stats, then hand the outputs to the event loop (counted before they
        go out: a client that has its last token and then reads /metrics sees its request
        in them)."""
        core = self.core
        self.num_requests_running = stats.num_running = core.num_running
        self.num_requests_waiting = stats.num_waiting = core.num_waiting
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _abort_all(self) -> None:
        """Leave no slot taken when the loop ends."""
        try:
            for rid in list(self.output_processor.requests):
                self.core.abort_requests(self.output_processor.abort(rid))
        except Exception:  # noqa: BLE001 - already on the way out
            logger.exception("aborting the requests left at shutdown failed")

    # -- back on the event loop -------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.error is not None:
                stream.put(RequestFailedError(out.error))
            else:
                stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self._streams):
            self._streams.pop(rid).put(EngineDeadError(f"the engine loop died: {err}"))

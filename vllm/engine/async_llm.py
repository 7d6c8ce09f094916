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

``engine_process`` (default: ``VLLM_ENABLE_V1_MULTIPROCESSING``, on) moves the engine core
(scheduler, runner, sampler) into a process of its own (``core_proc.py``): the background
thread then only forwards requests and aborts to it and turns its step results into
outputs (detokenizing, stop strings) while the core runs the next step, so the core's
steps never wait for the GIL that the event loop holds while it streams. The stat records
then carry the core process's step and loop times. A core process that dies is an engine
death as above.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncGenerator
from multiprocessing.connection import wait as wait_for

from vllm import envs
from vllm.config import EngineConfig
from vllm.engine.core_proc import EngineCoreClient, EngineCoreDied
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
    def __init__(
        self,
        config: EngineConfig,
        stat_loggers: list[StatLoggerBase] | None = None,
        engine_process: bool | None = None,
    ):
        self.config = config
        if engine_process is None:
            engine_process = envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self.engine_process = engine_process
        if engine_process:
            self.engine = LLMEngine(config, core_class=EngineCoreClient)
            # The loop thread waits on the core's pipe and on this socket, which a queued
            # request or abort pokes.
            self._poke_r, self._poke_w = socket.socketpair()
            self._poke_r.setblocking(False)
        else:
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
        processed = self.engine.process(prompt, params)
        self._ensure_loop()
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        self._queue(("add", request_id, processed, params, time.monotonic()))
        return stream

    def _queue(self, item) -> None:
        with self._wake:
            poke = self.engine_process and not self._inbox
            self._inbox.append(item)
            self._wake.notify()
        if poke:
            self._poke_w.send(b"\0")

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
        """Abort what runs, stop the loop thread and wait for it, then the core (its
        tensor-parallel workers). A second call does nothing."""
        if self._shut_down:
            return
        self._shut_down = True
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(EngineDeadError("the engine is shutting down"))
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self.engine_process:
            self._poke_w.send(b"\0")
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join)  # it joins the core process
        elif self.engine_process:
            await loop.run_in_executor(None, self.engine.core.join)
        if self.engine_process:
            self._poke_r.close()
            self._poke_w.close()
        else:
            self.engine.core.shutdown()  # the tensor-parallel workers, if any

    def _ensure_loop(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            run = self._run_proc if self.engine_process else self._run
            self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
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
                # The loop's time since its last record, less the wait and the step.
                now, step = clock(), stats.step
                stats.loop_other_s = max(
                    0.0, now - last_record - stats.loop_wait_s - (step.total_s if step else 0.0)
                )
                last_record = now
                self._publish(stats, outputs)
        except BaseException as err:  # noqa: BLE001 - every stream must hear of it
            self._died(err)
        finally:
            self._abort_all()

    def _died(self, err: BaseException) -> None:
        logger.exception("the engine loop died")
        self.errored, self.dead_error = True, err
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, err)

    def _run_proc(self) -> None:
        """The loop with the core in its own process: forward what the event loop queued,
        and turn each step result into outputs."""
        engine = self.engine
        client: EngineCoreClient = engine.core
        try:
            while True:
                ready = wait_for([client.conn, self._poke_r])
                if self._poke_r in ready:
                    self._take_inbox(engine, client)
                if client.conn not in ready:
                    continue
                try:
                    result = client.recv()
                except EngineCoreDied:
                    if client.closed:
                        break  # it was told to stop
                    raise
                if result is None:
                    break  # it said bye
                stats = IterationStats(
                    loop_wait_s=result.loop_wait_s, loop_other_s=result.loop_other_s
                )
                outputs = engine.process_step(result.outputs, result.step, stats)
                self._publish(stats, outputs)
        except BaseException as err:  # noqa: BLE001 - every stream must hear of it
            self._died(err)
        finally:
            client.join()

    def _take_inbox(self, engine: LLMEngine, client: EngineCoreClient) -> None:
        try:
            while self._poke_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._wake:
            inbox, self._inbox = self._inbox, []
            stopping = self._stopping
        stats = IterationStats()
        for op, rid, processed, params, arrival in inbox:
            if op == "add":
                engine.add_processed(rid, processed, params, arrival)
            else:
                engine.abort_request(rid, stats)
        if stats.finished:
            self._publish(stats, [])
        if stopping:
            client.shutdown()

    def _publish(self, stats: IterationStats, outputs: list[RequestOutput]) -> None:
        """Record the stats, then hand the outputs to the event loop (counted before they
        go out: a client that has its last token and then reads /metrics sees its request
        in them)."""
        core = self.engine.core
        self.num_requests_running = stats.num_running = core.num_running
        self.num_requests_waiting = stats.num_waiting = core.num_waiting
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        errors = self.engine.errors
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs, dict(errors))
        errors.clear()

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

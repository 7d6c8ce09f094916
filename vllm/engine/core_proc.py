"""The engine core in a process of its own (vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING``).

The server's front end (HTTP, tokenizing, detokenizing, SSE) and the engine core share one
GIL when they run as two threads of one process: every torch call the core makes releases
the GIL and must take it back, which waits while the event loop streams. Here the core
runs in a spawned child process that does nothing else: it takes requests and aborts from a
pipe, steps while it has work, and sends each step's ``EngineCoreOutput`` deltas back.

``MPClient`` (the parent's side) is an engine-core client (``core_client.py``):
``add_request`` and ``abort_requests`` queue messages that a sender thread writes (a caller
never blocks on a full pipe), and ``get_output`` (on the caller's thread) returns the next
``EngineCoreOutputs`` with its outputs named by the caller's request ids again.
``wait_for_output`` waits on the pipe and on a socket that ``poke`` writes to, whichever
comes first; ``shutdown`` asks the child to stop, reads the pipe to its goodbye and joins
it. The child names each request with an id unique for the client's life (``"{id}#{n}"``):
an output still in the pipe of a request aborted meanwhile matches nothing and is dropped,
even if a new request took the same id.

The protocol (pickled tuples): child -> parent ``("ready", info)`` once started (or
``("failed", message)``; ``("failed", error)`` for a user's error, ValueError or OSError,
which the parent raises as it is), then ``("step", EngineCoreOutputs)`` after every step it
runs and after every batch of messages it takes while idle, ``("dead", message)`` if its
loop fails, and ``("bye",)`` after a shutdown; parent -> child ``("add",
EngineCoreRequest)``, ``("abort", [ids])``, ``("shutdown",)``. A parent that goes away
closes the pipe: the child then stops.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import operator
import queue
import signal
import socket
import threading
import time
from dataclasses import fields, replace
from multiprocessing.connection import wait

from vllm.config import EngineConfig
from vllm.engine import core_client
from vllm.engine.core import EngineCoreOutput, EngineCoreRequest
from vllm.engine.core_client import EngineCoreOutputs
from vllm.errors import USER_ERRORS
from vllm.logger import init_logger

logger = init_logger(__name__)


# Outputs cross the pipe as plain tuples of their fields: a quarter of a dataclass's
# pickling time (256 outputs: 47 us against 193 us on the CPU machine).
_pack_one = operator.attrgetter(*(f.name for f in fields(EngineCoreOutput)))


def _pack(outputs: list[EngineCoreOutput]) -> list[tuple]:
    return [_pack_one(out) for out in outputs]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def run_engine_core(config: EngineConfig, conn) -> None:
    """The child's main: build the core, then serve the pipe until shutdown or EOF."""
    # Ctrl-C reaches the whole process group; the parent decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from vllm.engine.core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as err:  # noqa: BLE001 - the parent raises it
        if isinstance(err, USER_ERRORS):
            # A weight that does not fit, say: the parent raises the same error, whose
            # message says it all (the command prints it as one line).
            logger.debug("the engine core failed to start", exc_info=True)
            try:
                conn.send(("failed", err))
                return
            except Exception:  # noqa: BLE001 - an error that does not pickle: its text
                pass
        else:
            logger.exception("the engine core failed to start")
        conn.send(("failed", _describe(err)))
        return
    try:
        conn.send(("ready", {"vocab_size": core.vocab_size, "startup": core.startup}))
        _serve(core, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("the engine core's parent went away; stopping")
    except BaseException as err:  # noqa: BLE001 - every request must hear of it
        logger.exception("the engine core loop died")
        try:
            conn.send(("dead", _describe(err)))
        except OSError:
            pass
    finally:
        core.shutdown()


def _serve(core, conn) -> None:
    clock = time.perf_counter
    last = clock()
    while True:
        t_wait = clock()
        late = core.dispatch_deadline() if core.has_unfinished_requests() else None
        if late is not None:  # the device runs a step: new requests may still join the next
            conn.poll(max(0.0, late - t_wait))
        messages = [] if core.has_unfinished_requests() else [conn.recv()]
        wait_s = clock() - t_wait
        while conn.poll():
            messages.append(conn.recv())
        result = EngineCoreOutputs(loop_wait_s=wait_s)
        if late is not None:
            result.loop_wait_s, result.late_wait_s = 0.0, wait_s
            result.late_arrivals = sum(message[0] == "add" for message in messages)
        for message in messages:
            kind = message[0]
            if kind == "add":
                req = message[1]
                try:
                    core.add_request(req)
                except Exception as err:  # noqa: BLE001 - that request fails, not the core
                    result.outputs.append(
                        EngineCoreOutput(req.request_id, finish_reason="error", error=str(err))
                    )
            elif kind == "abort":
                core.abort_requests(message[1])
            elif kind == "shutdown":
                conn.send(("bye",))
                return
            else:
                raise ValueError(f"unknown message to the engine core: {kind!r}")
        if core.has_unfinished_requests():
            t0 = clock()
            result.outputs += core.step()
            result.step = core.last_step
            result.step.total_s = clock() - t0
        result.num_running, result.num_waiting = core.num_running, core.num_waiting
        now = clock()
        step_s = result.step.total_s if result.step is not None else 0.0
        result.loop_other_s = max(0.0, now - last - wait_s - step_s)
        last = now
        result.outputs = _pack(result.outputs)
        conn.send(("step", result))


class EngineCoreDied(RuntimeError):
    """The engine core process failed or exited."""


class MPClient(core_client.EngineCoreClient):
    """The parent's handle on the core process (see the module docstring)."""

    in_process = False

    def __init__(self, config: EngineConfig):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # Not a daemon: the core may start tensor-parallel workers of its own.
        self.proc = ctx.Process(
            target=run_engine_core, args=(config, child), name="vllm-engine-core"
        )
        self.proc.start()
        child.close()
        self.num_running = self.num_waiting = 0
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_id = 0
        self._internal: dict[str, str] = {}  # caller's id -> the child's
        self._external: dict[str, str] = {}  # the child's id -> caller's
        self.closed = False
        try:
            kind, info = self._recv_startup()
        except BaseException:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            if isinstance(info, BaseException):
                raise info
            raise RuntimeError(f"the engine core process failed to start: {info}")
        self.vocab_size: int = info["vocab_size"]
        self.startup: dict = info["startup"]
        logger.info("the engine core runs in process %d", self.proc.pid)
        # ``poke`` writes a byte here and ``wait_for_output`` waits on it beside the pipe.
        # Neither end blocks: a full buffer already holds a poke not yet read.
        self._poke_r, self._poke_w = socket.socketpair()
        self._poke_r.setblocking(False)
        self._poke_w.setblocking(False)
        self._sender = threading.Thread(target=self._send_loop, name="core-send", daemon=True)
        self._sender.start()
        # A caller that exits without shutting down (a script's end) stops the child here,
        # before multiprocessing's exit handler joins it.
        atexit.register(self._at_exit)

    def _recv_startup(self):
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            return "failed", f"it exited with status {self.proc.exitcode} while starting"

    # -- requests (the caller's thread; nothing here blocks) -----------------------------

    def add_request(self, req: EngineCoreRequest) -> None:
        internal = f"{req.request_id}#{self._next_id}"
        self._next_id += 1
        self._internal[req.request_id] = internal
        self._external[internal] = req.request_id
        self._outbox.put(("add", replace(req, request_id=internal)))

    def abort_requests(self, request_ids) -> None:
        internal = [i for rid in request_ids if (i := self._internal.pop(rid, None))]
        for i in internal:
            del self._external[i]
        if internal:
            self._outbox.put(("abort", internal))

    def has_unfinished_requests(self) -> bool:
        return bool(self._internal)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the child and wait for it: ask, read the pipe up to its "bye" (a child
        blocked sending a step's outputs would never see the request otherwise; what it
        sends meanwhile is dropped), then join it, killing it after ``timeout`` s.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)  # ends the sender thread
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0 and self.conn.poll(left):
                if self.conn.recv()[0] == "bye":
                    break
        except (EOFError, OSError):
            pass  # it is gone already
        self.proc.join(max(0.0, deadline - time.monotonic()))
        if self.proc.is_alive():
            logger.warning("the engine core process did not stop in %.0f s; killing it", timeout)
            self._kill()
        self.conn.close()
        self._poke_r.close()
        self._poke_w.close()

    def _at_exit(self) -> None:
        if self.proc.exitcode is None:
            self._outbox.put(("shutdown",))
            self.proc.join(30)
            if self.proc.is_alive():
                self._kill()

    def _kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:
                return  # the child is gone: recv reports it

    # -- results (the caller's thread) ---------------------------------------------------

    def get_output(self) -> EngineCoreOutputs | None:
        """The next step's result (blocks; the GIL is free meanwhile); None after the child
        said "bye". Raises EngineCoreDied when the child failed or exited unasked."""
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise EngineCoreDied(
                f"the engine core process exited (status {self.proc.exitcode})"
            ) from None
        kind = message[0]
        if kind == "bye":
            return None
        if kind == "dead":
            raise EngineCoreDied(f"the engine core loop died: {message[1]}")
        result: EngineCoreOutputs = message[1]
        outputs = []
        for packed in result.outputs:
            out = EngineCoreOutput(*packed)
            rid = self._external.get(out.request_id)
            if rid is None:
                continue  # aborted meanwhile
            out.request_id = rid
            if out.finish_reason is not None:
                del self._external[self._internal.pop(rid)]
            outputs.append(out)
        result.outputs = outputs
        self.num_running, self.num_waiting = result.num_running, result.num_waiting
        return result

    def wait_for_output(self) -> EngineCoreOutputs | None:
        ready = wait([self.conn, self._poke_r])
        if self._poke_r in ready:
            try:
                while self._poke_r.recv(4096):
                    pass
            except BlockingIOError:
                pass  # all read
            return None  # what was queued goes to the child before its outputs are read
        result = self.get_output()
        if result is None:  # only a shutdown makes it say goodbye, and that reads its own
            raise EngineCoreDied("the engine core process stopped unasked")
        return result

    def poke(self) -> None:
        try:
            self._poke_w.send(b"\0")
        except OSError:
            pass  # a full buffer holds a poke already; a closed one has nobody to wake

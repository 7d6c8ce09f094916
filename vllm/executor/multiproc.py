"""MultiprocExecutor: one process per tensor-parallel rank, driven from the engine's process.

    executor = MultiprocExecutor(2, functools.partial(MyWorker, config), config=model_config)
    result = executor.run("execute_model", step_inputs)   # rank 0's result
    executor.shutdown()

The engine's ``Executor`` for TP > 1 (``Executor.make``: its workers are ``Worker``s); any
picklable worker factory works (the tests drive it with workers of their own).
Rank 0 is the driver: it lives in the caller's process; ranks 1 .. N-1 are processes
started with torch.multiprocessing (spawn). Every rank joins the torch.distributed group
(``parallel_state.init_distributed``) and then builds its worker with ``worker_factory()``
(picklable: a top-level class or function, or a functools.partial of one; the worker reads
its rank from ``parallel_state``). ``run(method, *args, **kwargs)`` pickles the call once
and writes the bytes to every worker's pipe, then calls the method on rank 0's worker and
returns its result; the workers call the same method with the same arguments and keep
their results (the layers' collectives tie the ranks together). The call goes over pipes,
not a collective, so an idle engine waits for its next step without any timeout running.

Failures: a worker that raises reports its traceback through its pipe and exits; one that
is killed just dies. The driver notices either way and raises ``WorkerFailedError`` naming
the rank and the cause, instead of hanging:

- the driver's own collectives fail when a peer is gone (gloo at once; every backend after
  ``timeout_s``, the bound on any collective, which also catches a worker that hangs);
- while rank 0's part of a call runs (on the driver thread, below), the calling thread
  checks every ``poll_s`` that the workers are alive, so a death is reported even when
  the driver is blocked where no collective returns (a CUDA sync behind an NCCL kernel);
- start-up (joining the group, building the workers) is watched the same way (rank 0
  joins once every worker has reached the group, ``ARRIVAL_S``); one that
  times out names each worker's last stage and dumps the live workers' stacks to stderr
  (tp_process.py: also the rendezvous on a port rank 0's store binds and keeps).

Rank 0's work (joining the group, its worker, every call) runs on one daemon thread, always
the same one (the CUDA device, CUDA graphs and grad mode stay consistent), so the calling
thread can stop waiting on it. After any failure the executor is broken: the ranks may be
out of step, so it kills the workers and every later call raises the first error.
Configuration errors come before any process starts: ``config`` goes through
``check_tp_divisibility`` and the factory must pickle.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from vllm.distributed import parallel_state
from vllm.executor.abstract import Executor
from vllm.executor.tp_checks import check_tp_divisibility
from vllm.executor.tp_process import (
    SHUTDOWN,
    STAGES,
    DriverThread,
    abort_nccl,
    describe_ranks,
    dump_stacks,
    open_store,
    reached,
    thread_stack,
    worker_main,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

# Seconds the workers get at least to start Python, import and reach rank 0's store. Rank 0
# joins the group only after that, so a short collective timeout (fast failure detection)
# does not also have to cover a slow start on a loaded machine.
ARRIVAL_S = 60.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker process failed; ``rank`` and ``cause`` say which and why,
    ``worker_traceback`` is its traceback when it raised (None when it was killed)."""

    def __init__(self, rank: int, cause: str, worker_traceback: str | None = None):
        self.rank, self.cause, self.worker_traceback = rank, cause, worker_traceback
        message = f"tensor-parallel worker rank {rank} {cause}"
        if worker_traceback:
            message += f"\n--- worker rank {rank} traceback ---\n{worker_traceback}"
        super().__init__(message)


class MultiprocExecutor(Executor):
    def __init__(
        self,
        world_size: int,
        worker_factory: Callable[[], Any],
        *,
        backend: str | None = None,
        config: Any = None,
        timeout_s: float = parallel_state.DEFAULT_TIMEOUT_S,
        poll_s: float = 0.05,
        grace_s: float = 5.0,
    ):
        """Start ``world_size - 1`` worker processes and join them as rank 0.

        ``backend``: "nccl" or "gloo" (None: NCCL when CUDA is available). ``config``: a
        model config checked by ``check_tp_divisibility`` first. ``timeout_s`` bounds
        every collective and the start-up; ``grace_s`` is how long a failed call waits for
        a worker's report before raising without it.
        """
        if config is not None:
            check_tp_divisibility(config, world_size)
        elif isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size={world_size} needs {world_size} GPUs, "
                f"{torch.cuda.device_count()} are visible"
            )
        if parallel_state.is_initialized():
            raise RuntimeError("this process is already a rank of a tensor-parallel group")
        try:
            pickle.dumps(worker_factory)
        except Exception as err:
            raise ValueError(
                f"worker_factory must be picklable (a top-level class or function, or a "
                f"functools.partial of one) to reach the worker processes: {err}"
            ) from err
        if backend == "nccl":
            for key, value in parallel_state.MULTICAST_OFF_ENV.items():
                os.environ.setdefault(key, value)  # inherited by the spawned workers

        self.world_size = world_size
        self.timeout_s, self.poll_s, self.grace_s = timeout_s, poll_s, grace_s
        self._error: BaseException | None = None
        self._closed = False
        self._procs: dict[int, mp.Process] = {}
        self._conns: dict[int, Any] = {}
        self._reports: dict[int, tuple] = {}
        self._store = open_store(world_size, timeout_s)  # before anything it would leak
        port = self._store.port
        self._driver = DriverThread()
        ctx = mp.get_context("spawn")
        for rank in range(1, world_size):
            ours, theirs = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                args=(rank, world_size, backend, port, timeout_s, worker_factory, theirs),
                name=f"vllm-tp-worker-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            self._procs[rank], self._conns[rank] = proc, ours

        def start_driver():
            store = self._store
            parallel_state.init_distributed(world_size, 0, backend, None, timeout_s, store=store)
            return worker_factory()

        try:
            arrival = time.monotonic() + max(timeout_s, ARRIVAL_S)
            self._wait_workers(STAGES[1], "did not reach the group", arrival)
            self.driver_worker = self._wait(self._driver.submit(start_driver), timeout_s)
            self._wait_workers("ready", "did not start", time.monotonic() + timeout_s)
        except BaseException as err:
            self._fail(err)
            self.shutdown()
            raise

    @property
    def failed(self) -> bool:
        """A call or the start-up failed: the ranks may be out of step, so the executor
        refuses further calls."""
        return self._error is not None

    @property
    def worker_pids(self) -> dict[int, int]:
        return {rank: proc.pid for rank, proc in self._procs.items()}

    # -- calls ---------------------------------------------------------------------------

    def run(self, method: str, *args, **kwargs) -> Any:
        """Call ``method(*args, **kwargs)`` on every rank's worker; rank 0's result (rank 0
        runs in this process: it may hold device tensors, e.g. a step's handle)."""
        if self._error is not None:
            raise RuntimeError("the tensor-parallel executor has failed before") from self._error
        if self._closed:
            raise RuntimeError("the tensor-parallel executor is shut down")
        if not callable(getattr(self.driver_worker, method, None)):
            raise AttributeError(f"{type(self.driver_worker).__name__} has no method {method!r}")
        payload = pickle.dumps((method, args, kwargs))
        bound = getattr(self.driver_worker, method)
        try:
            try:
                self._check_workers()
                for conn in self._conns.values():
                    conn.send_bytes(payload)
            except OSError as err:  # a pipe to a worker that is gone
                failure = self._failure_after(err)
                if failure is err:
                    raise
                raise failure from err
            return self._wait(self._driver.submit(lambda: bound(*args, **kwargs)), None)
        except BaseException as err:
            self._fail(err)
            raise

    def _wait(self, future: concurrent.futures.Future, timeout_s: float | None) -> Any:
        """Rank 0's result, checking the workers every ``poll_s`` while it runs. When rank
        0's part raises, a worker failure found within ``grace_s`` (the usual cause of a
        broken collective) is raised instead, chained to it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            done, _ = concurrent.futures.wait([future], timeout=self.poll_s)
            if done:
                break
            self._check_workers()
            if deadline is not None and time.monotonic() > deadline:
                raise self._hung(f"rank 0 did not finish within {timeout_s} s", rank0=True)
        err = future.exception()
        if err is None:
            return future.result()
        failure = self._failure_after(err)
        if failure is err:
            err.add_note(
                f"tensor-parallel: every worker process was alive {self.grace_s} s after "
                f"rank 0's call failed (collectives time out after {self.timeout_s} s: a "
                "worker may be stuck, or the call failed on rank 0 itself)"
            )
            raise err
        raise failure from err

    def _failure_after(self, err: BaseException) -> BaseException:
        """The worker failure behind ``err`` if one shows within ``grace_s``, else ``err``."""
        if isinstance(err, WorkerFailedError):
            return err
        deadline = time.monotonic() + self.grace_s
        while True:
            try:
                self._check_workers()
            except WorkerFailedError as failure:
                return failure
            if time.monotonic() > deadline:
                return err
            time.sleep(self.poll_s)

    def _wait_workers(self, stage: str, failing: str, deadline: float) -> None:
        """Until every worker has reached ``stage`` (tp_process.STAGES); past ``deadline``
        a TimeoutError naming the ones that have not, "... workers [1] {failing}"."""
        pending = set(self._conns)
        while pending:
            self._check_workers()
            pending = {rank for rank in pending if not reached(self._reports.get(rank), stage)}
            if pending and time.monotonic() > deadline:
                raise self._hung(f"tensor-parallel workers {sorted(pending)} {failing}")
            time.sleep(self.poll_s if pending else 0)

    def _hung(self, what: str, rank0: bool = False) -> TimeoutError:
        """A start-up past its deadline: every worker's last stage (and with ``rank0``, rank
        0's stack) in the error, the live workers' stacks on stderr (before they are
        killed)."""
        dump_stacks(self._procs)
        self._read_reports()
        message = f"{what} while every worker process is alive; "
        message += describe_ranks(self._procs, self._reports)
        stack = thread_stack(self._driver.thread) if rank0 else ""
        return TimeoutError(message + (f"\n--- rank 0's thread ---\n{stack}" if stack else ""))

    # -- failures ------------------------------------------------------------------------

    def _read_reports(self) -> None:
        for rank, conn in self._conns.items():
            try:
                while conn.poll():
                    self._reports[rank] = conn.recv()
            except (EOFError, OSError):
                pass

    def _failure_of(self, rank: int) -> WorkerFailedError | None:
        report = self._reports.get(rank)
        if report is not None and report[0] == "error":
            return WorkerFailedError(rank, f"raised {report[1]}", report[2])
        code = self._procs[rank].exitcode
        if code is None:
            return None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return WorkerFailedError(rank, f"was killed by {name} (exit code {code})")
        return WorkerFailedError(rank, f"exited with code {code}")

    def _check_workers(self) -> None:
        self._read_reports()
        for rank in self._procs:
            failure = self._failure_of(rank)
            if failure is not None:
                raise failure

    def _fail(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
        self._stop_workers(graceful=False)
        if parallel_state.get_tp_group().backend == "nccl":
            abort_nccl()

    # -- shutdown ------------------------------------------------------------------------

    def _stop_workers(self, graceful: bool) -> None:
        if graceful:
            for conn in self._conns.values():
                try:
                    conn.send_bytes(SHUTDOWN)
                except OSError:
                    pass
            for proc in self._procs.values():
                proc.join(self.grace_s)
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self._procs.values():
            proc.join(self.grace_s)

    def shutdown(self) -> None:
        """Stop the workers (politely when the executor is healthy, by SIGKILL otherwise)
        and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_workers(graceful=self._error is None)
        # Rank 0 leaves the group on its own thread, unless a failed call still holds it.
        concurrent.futures.wait([self._driver.submit(parallel_state.destroy)], self.grace_s)
        self._driver.stop()
        self._store = None  # rank 0's rendezvous store and its port, released
        for conn in self._conns.values():
            conn.close()

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

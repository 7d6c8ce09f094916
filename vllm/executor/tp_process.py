"""The process side of ``MultiprocExecutor``: the rendezvous store, a worker process's main
loop, rank 0's driver thread, and what a start-up that hangs reports.

Rendezvous: rank 0 opens torch.distributed's TCPStore on 127.0.0.1 with port 0, so the
kernel binds a free port and the store holds it from then on; the workers get that port
and join as clients. (Picking a free port, closing it and binding it again later leaves a
gap in which another process can take it: a worker may then connect to a stranger and
wait there, while rank 0 waits for it.) Gloo's own sockets go over the loopback device
(``parallel_state.use_loopback_for_gloo``), so a start-up never depends on the host name
resolving to a reachable address.

A worker reports where it is through its pipe: ``("stage", what, seconds since start)``
while it joins the group and builds its worker (``STAGES``, in order), ``("ready",)``, or
``("error", summary, traceback)``. Rank 0 joins the group only once every worker has
reached it, so the group's timeout does not also have to cover the workers' interpreters
starting and importing (seconds on a loaded machine). A start-up that times out names
every rank's last stage, and the workers still alive dump their threads' stacks to stderr
(faulthandler on SIGUSR1) before they are killed: a hang on a machine nobody can log into
still says where it hung.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import faulthandler
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from vllm.distributed import parallel_state
from vllm.logger import init_logger

logger = init_logger(__name__)

SHUTDOWN = b"shutdown"
# A worker's stages, in order; the last is its ("ready",) report.
STAGES = ("connecting to rank 0's store", "joining the group", "building its worker", "ready")
STORE_HOST = "127.0.0.1"
# Seconds a worker gets to write its stacks after SIGUSR1, before it is killed.
STACK_DUMP_S = 1.0


def open_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a port the kernel picks and the store keeps."""
    return dist.TCPStore(
        STORE_HOST,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A worker's client of rank 0's store."""
    return dist.TCPStore(
        STORE_HOST,
        port,
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def worker_main(rank, world_size, backend, port, timeout_s, factory, conn) -> None:
    """A worker process: join, build, then serve calls from the pipe until shutdown."""
    start = time.monotonic()

    def stage(what: str) -> None:
        conn.send(("stage", what, round(time.monotonic() - start, 2)))

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        stage(STAGES[0])
        store = join_store(port, world_size, timeout_s)
        stage(STAGES[1])
        parallel_state.init_distributed(world_size, rank, backend, None, timeout_s, store=store)
        stage(STAGES[2])
        worker = factory()
        conn.send(("ready",))
        while True:
            try:
                payload = conn.recv_bytes()
            except EOFError:
                return  # the driver is gone: nobody to serve or to report to
            if payload == SHUTDOWN:
                return
            method, args, kwargs = pickle.loads(payload)
            getattr(worker, method)(*args, **kwargs)
    except BaseException as err:
        summary = f"{type(err).__name__}: {err}"
        try:
            conn.send(("error", summary, traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        parallel_state.destroy()


def reached(report: tuple | None, stage: str) -> bool:
    """Whether a worker whose last report is ``report`` has reached ``stage`` of ``STAGES``."""
    if report is None or report[0] not in ("stage", "ready"):
        return False
    where = report[1] if report[0] == "stage" else "ready"
    return STAGES.index(where) >= STAGES.index(stage)


def describe_ranks(procs: dict, reports: dict) -> str:
    """Every worker's pid and last reported stage, for an error message."""
    parts = []
    for rank, proc in procs.items():
        report = reports.get(rank)
        if report is None:
            where = "no report yet (still starting Python and importing)"
        elif report[0] == "stage":
            where = f"{report[1]} (reached {report[2]} s after it started)"
        else:
            where = report[0]
        parts.append(f"rank {rank} (pid {proc.pid}): {where}")
    return "; ".join(parts)


def dump_stacks(procs: dict) -> None:
    """Ask the live workers to write their threads' stacks to stderr, and give them
    ``STACK_DUMP_S`` to do it."""
    asked = False
    for proc in procs.values():
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGUSR1)
                asked = True
            except OSError:
                pass
    if asked:
        time.sleep(STACK_DUMP_S)


def thread_stack(thread: threading.Thread) -> str:
    """``thread``'s current Python stack, formatted (empty when it has ended)."""
    frame = sys._current_frames().get(thread.ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


class DriverThread:
    """Rank 0's thread: runs submitted callables one at a time, in order."""

    def __init__(self):
        self._calls: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="vllm-tp-driver", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._calls.get()
            if fn is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    future.set_exception(err)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, future))
        return future

    def stop(self) -> None:
        self._calls.put((None, None))


def abort_nccl() -> None:
    """Abort this process's NCCL communicators, so that rank 0's thread, blocked behind an
    NCCL kernel whose peer is gone, returns and can leave the group. torch's
    ``_abort_process_group`` is experimental; where it is missing or fails, NCCL's watchdog
    ends the wait after the group's timeout. (Not yet run on a multi-GPU machine.)"""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None or not dist.is_initialized():
        return
    try:
        abort()
    except Exception as err:  # noqa: BLE001 - best effort on a path that is failing anyway
        logger.warning("aborting the NCCL communicators failed: %s", err)

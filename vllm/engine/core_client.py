"""The engine-core client: how ``LLMEngine`` and ``AsyncLLM`` drive an engine core, wherever
it runs (vLLM's ``vllm/v1/engine/core_client.py``).

``EngineCoreClient`` is the interface: ``add_request`` / ``abort_requests`` (queued, never
blocking on the core), ``get_output()`` (the next step's ``EngineCoreOutputs``; None once
the core said goodbye), ``has_unfinished_requests``, ``num_running`` / ``num_waiting``
(as of the last output), ``vocab_size`` and ``startup`` (the workers' start-up record),
``shutdown()`` (stops the core and waits for it). Two kinds:

- ``InprocClient``: the ``EngineCore`` in this process; ``get_output()`` runs one core
  step on the caller's thread (``LLM``, and the server without an engine process);
- ``MPClient`` (``core_proc.py``): the core in a process of its own, whose steps run
  there back to back; ``get_output()`` receives the next one.

A loop that also takes requests from other threads (``AsyncLLM``'s) calls
``wait_for_output()`` instead, and those threads call ``poke()`` after queueing
something for it: a wait for outputs then returns None at once, so the loop hands the new
requests and aborts over and asks again. The poke is each client's own (a condition in
process, a socket beside the core's pipe otherwise), so the loop is the same over both.

``in_process`` says which: a step's output processing then runs after the step (its time
counts in the step's total) rather than beside the core's next step.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from vllm.config import EngineConfig
from vllm.engine.core import EngineCore, EngineCoreOutput, EngineCoreRequest
from vllm.engine.stats import StepStats


@dataclass
class EngineCoreOutputs:
    """One step's outputs (``step`` None: the core took messages, ran no step), its counts
    after it, and the time since the previous result, outside the step, of the loop that
    steps the core (the core process's loop; in process, the caller's): blocked waiting
    for work, and the rest (taking messages or queued requests, handing outputs on).
    ``late_wait_s``: the time it waited for requests while the device ran a step
    (``--late-dispatch``), ``late_arrivals``: the requests that arrived in that wait and
    go into this step."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step: StepStats | None = None
    num_running: int = 0
    num_waiting: int = 0
    loop_wait_s: float = 0.0
    loop_other_s: float = 0.0
    late_wait_s: float = 0.0
    late_arrivals: int = 0


class EngineCoreClient(ABC):
    in_process: bool
    vocab_size: int
    startup: dict
    num_running: int
    num_waiting: int

    @abstractmethod
    def add_request(self, req: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids) -> None: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs | None: ...

    @abstractmethod
    def wait_for_output(self) -> EngineCoreOutputs | None:
        """The next outputs, or None when ``poke()`` ends the wait for them (a poke since
        the last return counts). In process a core with work runs one step at once (what
        was queued meanwhile joins the next one) and an idle one waits for a poke; the
        core process's outputs end the wait as they come, and a poke comes first."""

    @abstractmethod
    def poke(self) -> None:
        """From any thread: the caller queued requests or aborts (or wants to stop), so a
        ``wait_for_output`` waiting for outputs returns None now rather than after the
        core's next step."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process (``engine_core``), stepped by the caller."""

    in_process = True

    def __init__(self, config: EngineConfig):
        self.engine_core = EngineCore(config)
        self.vocab_size = self.engine_core.vocab_size
        self.startup = self.engine_core.startup
        self._poke = threading.Condition()
        self._poked = False
        # The caller's loop time for ``EngineCoreOutputs``: when its previous step began,
        # that step (whose total_s the caller extends by its output processing), and the
        # time blocked in ``wait_for_output`` since.
        self._since: float | None = None
        self._last_step: StepStats | None = None
        self._waited = 0.0
        # A late-dispatch wait (late_dispatch.py) since the last step, and whether a poke
        # ended it (the requests then taken are its arrivals).
        self._late_s = 0.0
        self._late_poked = False

    @property
    def num_running(self) -> int:
        return self.engine_core.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine_core.num_waiting

    def add_request(self, req: EngineCoreRequest) -> None:
        self.engine_core.add_request(req)

    def abort_requests(self, request_ids) -> None:
        self.engine_core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_output(self) -> EngineCoreOutputs:
        core = self.engine_core
        t0 = time.perf_counter()
        since = t0 if self._since is None else self._since
        last_s = self._last_step.total_s if self._last_step is not None else 0.0
        other_s = max(0.0, t0 - since - last_s - self._waited)
        arrivals = core.num_waiting if self._late_poked else 0
        outputs = core.step()
        step = core.last_step
        step.total_s = time.perf_counter() - t0
        result = EngineCoreOutputs(
            outputs, step, core.num_running, core.num_waiting, self._waited, other_s
        )
        result.late_wait_s, result.late_arrivals = self._late_s, arrivals
        self._since, self._last_step, self._waited = t0, step, 0.0
        self._late_s, self._late_poked = 0.0, False
        return result

    def wait_for_output(self) -> EngineCoreOutputs | None:
        core = self.engine_core
        t0 = time.perf_counter()
        if self._since is None:
            self._since = t0
        with self._poke:
            # Only the caller's thread changes the core, so while it is idle nothing but a
            # poke can give it work. A poke is spent either way: the caller takes its queue
            # before every call.
            while not self._poked and not core.has_unfinished_requests():
                self._poke.wait()
            t_idle = time.perf_counter()
            late = None if self._poked else core.dispatch_deadline()
            if late is not None:  # the device runs a step: new requests may still join
                self._poke.wait(max(0.0, late - t_idle))
                self._late_s += time.perf_counter() - t_idle
                self._late_poked = self._poked
            poked, self._poked = self._poked, False
        self._waited += t_idle - t0
        if poked and late is not None:
            return None  # the caller takes its queue (the arrivals), then steps at once
        return self.get_output() if core.has_unfinished_requests() else None

    def poke(self) -> None:
        with self._poke:
            self._poked = True
            self._poke.notify()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

"""The engine-core client: how ``LLMEngine`` (and the server's loop) drives an engine core,
wherever it runs (vLLM's ``vllm/v1/engine/core_client.py``).

``EngineCoreClient`` is the interface: ``add_request`` / ``abort_requests`` (queued, never
blocking on the core), ``get_output()`` (the next step's ``EngineCoreOutputs``; None once
the core said goodbye), ``has_unfinished_requests``, ``num_running`` / ``num_waiting``
(as of the last output), ``vocab_size`` and ``startup`` (the workers' start-up record),
``shutdown()``. Two kinds:

- ``InprocClient``: the ``EngineCore`` in this process; ``get_output()`` runs one core
  step on the caller's thread (``LLM``, and the server without an engine process);
- ``MPClient`` (``core_proc.py``): the core in a process of its own, whose steps run
  there back to back; ``get_output()`` receives the next one.

``in_process`` says which: a step's output processing then runs after the step (its time
counts in the step's total) rather than beside the core's next step.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from vllm.config import EngineConfig
from vllm.engine.core import EngineCore, EngineCoreOutput, EngineCoreRequest
from vllm.engine.stats import StepStats


@dataclass
class EngineCoreOutputs:
    """One step's outputs (``step`` None: the core took messages, ran no step), its counts
    after it, and for a core in its own process that process's loop time since the previous
    result outside the step: blocked waiting for work, and the rest (taking messages,
    sending)."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    step: StepStats | None = None
    num_running: int = 0
    num_waiting: int = 0
    loop_wait_s: float = 0.0
    loop_other_s: float = 0.0


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
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in this process (``engine_core``), stepped by the caller."""

    in_process = True

    def __init__(self, config: EngineConfig):
        self.engine_core = EngineCore(config)
        self.vocab_size = self.engine_core.vocab_size
        self.startup = self.engine_core.startup

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
        outputs = core.step()
        step = core.last_step
        step.total_s = time.perf_counter() - t0
        return EngineCoreOutputs(outputs, step, core.num_running, core.num_waiting)

    def shutdown(self) -> None:
        self.engine_core.shutdown()

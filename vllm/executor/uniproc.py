"""UniprocExecutor: one GPU (or the CPU), its one ``Worker`` in the engine's process, called
on the caller's thread: a step costs a method call, nothing is pickled."""

from __future__ import annotations

from typing import Any

from vllm.config import EngineConfig
from vllm.executor.abstract import Executor
from vllm.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.driver_worker = Worker(config)

    def run(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.driver_worker, method)(*args, **kwargs)

    def shutdown(self) -> None:
        """Nothing to stop: the worker lives and dies with this process."""

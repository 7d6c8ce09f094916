"""Executor: how the engine core runs a step on the model's ranks, one interface for any
tensor-parallel size (vLLM's ``vllm/v1/executor/abstract.py``).

``Executor.make(config)`` picks the kind: ``UniprocExecutor`` (one ``Worker`` in this
process, called on this thread: TP = 1) or ``MultiprocExecutor`` (one process per rank,
rank 0's worker in this process: TP > 1). Either way ``driver_worker`` is rank 0's worker,
in this process, and

- ``execute_model(inputs)`` runs a step on every rank and returns rank 0's handle on it
  (``vllm.step_io.StepHandle``); it raises when the step failed;
- ``failed``: a step failed in a way that leaves the ranks out of step (a worker process
  died or raised); the executor then refuses every call, and the engine is dead;
- ``apply(fn, *args)`` runs ``fn(worker, *args)`` on every rank and returns rank 0's result
  (vLLM's ``collective_rpc`` with a callable: tools that need each rank's runner);
- ``vocab_size``, ``num_kv_blocks`` and ``startup`` are what the engine needs to know of
  the model and its caches, from rank 0's worker (the ranks agree on the sizes measured
  from memory: ``min_over_ranks``);
- ``shutdown()`` stops the workers (idempotent).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any

import torch

from vllm.step_io import StepHandle, StepInputs


class Executor(ABC):
    driver_worker: Any  # rank 0's Worker

    @staticmethod
    def make(config) -> Executor:
        """The executor of ``config.tensor_parallel_size`` ranks, its workers started."""
        # Imported here: both kinds subclass this module's class, and the worker imports
        # vllm.config, which imports this package (its tp_checks).
        from vllm.executor.multiproc import MultiprocExecutor
        from vllm.executor.uniproc import UniprocExecutor
        from vllm.worker.worker import Worker

        if config.tensor_parallel_size == 1:
            return UniprocExecutor(config)
        return MultiprocExecutor(
            config.tensor_parallel_size,
            functools.partial(Worker, config),
            backend="nccl" if torch.device(config.device).type == "cuda" else "gloo",
            config=config.model_config,
        )

    @abstractmethod
    def run(self, method: str, *args, **kwargs) -> Any:
        """``method(*args, **kwargs)`` on every rank's worker; rank 0's result."""

    @property
    def failed(self) -> bool:
        return False

    def execute_model(self, inputs: StepInputs) -> StepHandle:
        return self.run("execute_model", inputs)

    def apply(self, fn, *args, **kwargs) -> Any:
        return self.run("apply", fn, *args, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.driver_worker.runner.model.config.vocab_size

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of the paged KV cache (0: the model has no attention layers)."""
        return self.driver_worker.runner.cache.num_blocks

    @property
    def startup(self) -> dict:
        """The start-up times (weights, compile, graphs) and sizes of rank 0's runner."""
        return self.driver_worker.runner.startup

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers. Idempotent."""

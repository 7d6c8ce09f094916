"""Running the model's ranks for the engine core: one interface (``Executor``), one process
(``uniproc``, TP = 1) or one process per tensor-parallel rank (``multiproc``), and the
configuration check that comes before any of them starts (``tp_checks``)."""

from vllm.executor.abstract import Executor
from vllm.executor.multiproc import MultiprocExecutor, WorkerFailedError
from vllm.executor.tp_checks import check_tp_divisibility

__all__ = ["Executor", "MultiprocExecutor", "WorkerFailedError", "check_tp_divisibility"]

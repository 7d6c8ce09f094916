"""Running a model over several processes: one per tensor-parallel rank (``multiproc``),
and the configuration check that comes before any of them starts (``tp_checks``)."""

from vllm.executor.multiproc import MultiprocExecutor, WorkerFailedError
from vllm.executor.tp_checks import check_tp_divisibility

__all__ = ["MultiprocExecutor", "WorkerFailedError", "check_tp_divisibility"]

"""Worker: one tensor-parallel rank's model runner, built in its process.

``MultiprocExecutor`` (``vllm/executor/multiproc.py``) starts one process per rank (rank 0
in the engine's own process), joins them to the torch.distributed group and builds a
``Worker(config)`` on each: a ``ModelRunner`` whose model is this rank's shard (its heads,
its vocabulary rows), its state pool sized from the shard's specs, on this rank's device
(GPU ``rank % device_count`` under NCCL, the CPU under gloo). Every rank does the same
start-up (weights, warm-up steps, CUDA-graph capture) in lockstep, since the collectives
inside the model tie them together.

Each step, rank 0 (the engine) flattens the scheduled batch into ``StepInputs``
(``ModelRunner.prepare``) and the executor sends that one object to every rank
(``execute_model``); each rank runs the same forward, rank 0 returns the logits it
gathered and samples. The step's sampled tokens stay with rank 0, so tensor-parallel
engines read each step's tokens before dispatching the next (no async scheduling).
"""

from __future__ import annotations

from vllm.engine.config import EngineConfig
from vllm.worker.model_runner import ModelRunner, StepInputs, StepResult


class Worker:
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)

    def execute_model(self, inputs: StepInputs) -> StepResult:
        return self.runner.execute_inputs(inputs)

    def startup(self) -> dict:
        return self.runner.startup

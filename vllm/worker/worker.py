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
gathered and samples. Under async scheduling a step's decode rows take their input tokens
from the previous step's sampled tokens, which only rank 0 has, on its device: rank 0
broadcasts them (one device collective, no host sync) and every rank fills its rows.
"""

from __future__ import annotations

import torch

from vllm.config import EngineConfig
from vllm.distributed.communication_op import broadcast
from vllm.worker.model_runner import ModelRunner, StepInputs, StepResult


class Worker:
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)

    def execute_model(
        self,
        inputs: StepInputs,
        num_prev_tokens: int = 0,
        prev_tokens: torch.Tensor | None = None,
    ) -> StepResult:
        """Run the step; rank 0's result carries the logits. ``prev_tokens`` (rank 0 only:
        the previous step's ``num_prev_tokens`` sampled tokens) fills pending input tokens
        on every rank when the step has any."""
        if inputs.fill_dst:
            if prev_tokens is None:  # a worker: receive rank 0's tokens
                prev_tokens = torch.empty(
                    num_prev_tokens, dtype=torch.long, device=self.runner.device
                )
            prev_tokens = broadcast(prev_tokens.long().contiguous(), src=0)
        return self.runner.execute_inputs(inputs, prev_tokens)

    def apply(self, fn, *args, **kwargs):
        """``fn(self, *args, **kwargs)`` on this rank: ``executor.run("apply", fn, ...)``
        runs a picklable function (a module-level one) on every rank's worker and returns
        rank 0's result, as vLLM's ``collective_rpc`` does with a callable. For tools that
        need each rank's runner, group or device beside the steps (benchmark_tp.py)."""
        return fn(self, *args, **kwargs)

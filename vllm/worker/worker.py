"""Worker: one tensor-parallel rank's device work (one worker in all at TP = 1).

The executor (``vllm/executor``) builds a ``Worker(config)`` per rank: in the engine's
process at TP = 1 (``UniprocExecutor``), one process per rank otherwise
(``MultiprocExecutor``; rank 0 in the engine's process). Its ``ModelRunner`` holds this
rank's shard of the model (its heads, its vocabulary rows), the caches its specs describe
and the CUDA graphs, on this rank's device (GPU ``rank % device_count`` under NCCL, the CPU
under gloo). Every rank does the same start-up (weights, warm-up steps, graph capture) in
lockstep, since the collectives inside the model tie them together.

Each step every rank gets the same ``StepInputs`` (``execute_model``) and runs the same
forward; rank 0 then samples its gathered logits (``sampler.py``), computes the
log-probabilities asked for, queues their copy into pinned host memory
(``host_copy.HostCopy``) and returns an ``AsyncStepOutput`` whose ``get()`` waits for that
copy only: under async scheduling the engine reads it one step later, while the next
step runs. Rank 0 also times the step's device span (CUDA events) and counts the Triton
kernel variants the step compiled (launches the start-up warm-up missed), logging a
warning that names them. The other ranks return nothing.

Under async scheduling a step's decode rows take their input tokens from the previous
step's sampled tokens, which the host has not read: rank 0 keeps them on its device and
broadcasts them when a step has such rows (one device collective, no host sync), and every
rank fills its rows from them.
"""

from __future__ import annotations

import torch

from vllm.config import EngineConfig
from vllm.distributed.communication_op import broadcast
from vllm.distributed.parallel_state import get_tp_group
from vllm.logger import init_logger
from vllm.step_io import SamplingMetadata, StepInputs, StepOutput
from vllm.triton_utils.launch import launch_misses
from vllm.worker.host_copy import DeviceSpan, HostCopy
from vllm.worker.model_runner import ModelRunner
from vllm.worker.sampler import SampledLogprobs, Sampler, compute_logprobs

logger = init_logger(__name__)


class AsyncStepOutput:
    """Rank 0's handle on a dispatched step (a ``vllm.step_io.StepHandle``): its tokens,
    and its logprobs and prompt logprobs where it has them, being copied to the host in that
    order; ``get()`` waits for that copy and builds the ``StepOutput``."""

    def __init__(
        self,
        host: HostCopy,
        has_logprobs: bool,
        has_prompt_logprobs: bool,
        errors: dict[int, str],
        span: DeviceSpan | None,
        compiles: dict[str, int],
        graph: bool = False,
    ):
        self._host: HostCopy | None = host
        self._has_logprobs = has_logprobs
        self._has_prompt_logprobs = has_prompt_logprobs
        self._errors = errors
        self._span = span
        self._compiles = compiles
        self._graph = graph
        self._output: StepOutput | None = None

    def get(self) -> StepOutput:
        if self._output is None:
            host = list(self._host.get())
            self._host = None  # the pinned buffers go back now
            tokens = host.pop(0).tolist()
            n = SampledLogprobs.NUM_TENSORS
            lists = [SampledLogprobs(*host[i : i + n]).to_lists() for i in range(0, len(host), n)]
            self._output = StepOutput(
                tokens,
                logprobs=lists.pop(0) if self._has_logprobs else None,
                prompt_logprobs=lists.pop(0) if self._has_prompt_logprobs else None,
                errors=self._errors,
                # The span ends ahead of the copy, so it is done by now.
                device_s=self._span.seconds() if self._span is not None else None,
                kernel_compiles=sum(self._compiles.values()),
                compiles_by_kernel=self._compiles,
                graph=self._graph,
            )
        return self._output


class Worker:
    def __init__(self, config: EngineConfig):
        self.runner = ModelRunner(config)
        self.device = self.runner.device
        self.is_driver = get_tp_group().rank == 0
        # Rank 0 samples; the other ranks only run the forward.
        self.sampler = Sampler(self.device, config.seed) if self.is_driver else None
        self.num_steps = 0
        # The previous step's sampled tokens (rank 0's, on its device), and how many there
        # were (every rank: a worker receives rank 0's into a buffer of that size).
        self._prev_tokens: torch.Tensor | None = None
        self._num_prev = 0

    @torch.no_grad()
    def execute_model(self, inputs: StepInputs) -> AsyncStepOutput | None:
        """Queue the step (forward, then on rank 0 sampling and logprobs) and return rank
        0's handle on it; None on the other ranks. Raises when the forward fails (the
        step's requests fail; a row whose sampling fails is reported in the output)."""
        misses = launch_misses()  # a dict over the ~10 launchers: microseconds
        md = inputs.sampling
        if self.is_driver:
            self.sampler.forget(md.forget)
        span = DeviceSpan.open(self.device) if self.is_driver else None
        # Taken now, so that after a failed step no later one fills from stale tokens.
        prev, self._prev_tokens = self._prev_tokens, None
        if inputs.state_copies:
            self.runner.copy_state_lines(inputs.state_copies)
        if inputs.kv_copies:
            self.runner.copy_kv_blocks(inputs.kv_copies)
        result = self.runner.execute_inputs(inputs, self._pending_tokens(inputs, prev))
        self._num_prev = len(inputs.sample_rows)
        if not self.is_driver:
            return None
        tokens, errors = self._sample(result.logits, md)
        self._prev_tokens = tokens
        parts = [tokens]
        ks = [k for k in md.logprobs if k is not None]
        if ks:
            parts += compute_logprobs(result.logits, tokens, max(ks)).tensors()
        if result.prompt_logits is not None:
            prompt = compute_logprobs(result.prompt_logits, md.prompt_targets, md.prompt_k)
            parts += prompt.tensors()
        if span is not None:
            span.close()  # ahead of the copy, whose event the read waits for
        host = HostCopy(parts)
        compiles = self._count_compiles(misses)
        self.num_steps += 1
        return AsyncStepOutput(
            host,
            bool(ks),
            result.prompt_logits is not None,
            errors,
            span,
            compiles,
            graph=result.graph,
        )

    def _pending_tokens(self, inputs: StepInputs, prev: torch.Tensor | None):
        """The previous step's sampled tokens on this rank's device, when this step has
        input rows to fill from them (rank 0 broadcasts its own; a single rank keeps them)."""
        if not inputs.fill_dst:
            return None
        if prev is None:
            if self.is_driver:
                raise RuntimeError("pending input tokens but no previous step's tokens to fill")
            prev = torch.empty(self._num_prev, dtype=torch.long, device=self.device)
        return broadcast(prev.contiguous(), src=0)

    def _sample(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """One token per sampled row, and {row: message} of the rows whose sampling failed:
        when the batch's sampling raises, each row is sampled apart from the others, so a
        bad request fails alone (its token is then 0, and meaningless)."""
        try:
            return self.sampler.sample(logits, md), {}
        except Exception:  # noqa: BLE001 - find the row(s) at fault, one by one
            logger.exception("sampling a batch failed; sampling its rows one by one")
        tokens = torch.zeros(len(md), dtype=torch.long, device=logits.device)
        errors = {}
        for i in range(len(md)):
            try:
                tokens[i : i + 1] = self.sampler.sample(logits[i : i + 1], md.row(i))
            except Exception as err:  # noqa: BLE001 - reported with the row
                errors[i] = f"{type(err).__name__}: {err}"
        return tokens, errors

    def _count_compiles(self, before: dict[str, int]) -> dict[str, int]:
        """{kernel: variants} this step compiled since ``before``; warns when any."""
        missed = {k: n - before.get(k, 0) for k, n in launch_misses().items()}
        missed = {k: n for k, n in missed.items() if n}
        if missed:
            logger.warning(
                "step %d compiled %d Triton kernel variant(s) the start-up warm-up missed: %s",
                self.num_steps,
                sum(missed.values()),
                ", ".join(f"{k} ({n})" for k, n in missed.items()),
            )
        return missed

    def materialise(self, slots) -> None:
        """``ModelRunner.materialise`` on this rank (each rank holds its heads' states)."""
        self.runner.materialise(slots)

    def apply(self, fn, *args, **kwargs):
        """``fn(self, *args, **kwargs)`` on this rank: ``executor.apply(fn, ...)`` runs a
        picklable function (a module-level one) on every rank's worker and returns rank 0's
        result, as vLLM's ``collective_rpc`` does with a callable. For tools that need each
        rank's runner, group or device beside the steps (benchmark_tp.py)."""
        return fn(self, *args, **kwargs)

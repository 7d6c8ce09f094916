"""EngineCore: scheduler + executor; each step returns the new tokens of every running
request (deltas), not only the finished ones. It does no device work itself.

A step: the scheduler picks one mixed batch (and, with attention layers, the KV blocks of
its tokens: ``KVCacheManager``), the core flattens it into ``StepInputs`` with the
sampling parameters of the rows that end a sequence's known tokens (``input_builder.py``),
and the executor runs it (``vllm/executor``: one worker in this process at TP = 1, one
process per rank otherwise); the worker samples one token for each such row and returns a
handle on the step's host results (``vllm.step_io``). Each of those sequences then takes
its token and may finish (EOS, a stop token id, max_tokens, max_model_len), which frees
its slot (and blocks) at once. The core knows token ids only (text, stop strings and the
``n > 1`` fan-out are the output processor's); step times go to ``step_budget.py``.

Async scheduling (``EngineConfig.async_scheduling``, on by default, as vLLM's
``--async-scheduling``): a step is dispatched before the host has read the previous
step's tokens. Its decode rows take their input tokens on the device from the previous
step's sampled tokens, which the worker keeps (``PENDING_TOKEN`` stands for them on the
host), and only then does the core read the previous step's handle while the device runs
the new step. That read waits for the previous step only (the worker's pinned host copy,
``vllm/worker/host_copy.py``), so the device is not left idle while the host applies the
tokens and prepares the next step. A sequence that ends (EOS, or an abort: a stop string,
a client gone) has been dispatched in one more step by then; that step's token for it is
dropped, so outputs are the same as without async scheduling. ``max_tokens`` is known
ahead, so no step is wasted on it.

Failures stay with their request: one whose sampling fails is finished with ``error``
set and its slot freed; a failed forward fails its batch's requests only (the scheduler
is never left half-updated). A failed tensor-parallel step (``executor.failed``) leaves
the ranks out of step: the engine is then dead, every request fails with the error.

Each step leaves its host timing and token counts in ``last_step`` (``StepStats``: the
scheduler, the dispatch, the read of a dispatched step's tokens; no device sync added).
The device span of the step read (CUDA events), the Triton kernel variants it compiled (a
launch the start-up warm-up missed) and whether it replayed a CUDA graph come with it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from vllm.config import EngineConfig
from vllm.engine import late_dispatch
from vllm.engine.block_hash import hash_blocks
from vllm.engine.input_builder import build_step_inputs
from vllm.engine.scheduler import ScheduledBatch, Scheduler
from vllm.engine.sequence import PENDING_TOKEN, Sequence
from vllm.engine.stats import StepStats
from vllm.engine.step_budget import MixedStepBudget, StepTimes
from vllm.executor import Executor
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.step_io import StepHandle, StepOutput

logger = init_logger(__name__)

# {token id: (logprob, rank)} at one position; the output processor adds the text.
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # n == 1: the output processor fans n > 1 out into children
    eos_token_id: int | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None
    # With the first output token: the prompt tokens restored from the prefix cache.
    num_cached_tokens: int | None = None


@dataclass
class _Dispatched:
    """A step on its way: sampled row i of ``handle``'s output is the token of ``seqs[i]``,
    to go at ``positions[i]`` of its token list; its prompt-logprob rows are the spans
    (sequence, first position, count) of ``prompt_spans``, in order. ``output``: the
    handle's output once read."""

    seqs: list[Sequence]
    positions: list[int]
    prompt_spans: list[tuple[Sequence, int, int]]
    handle: StepHandle
    num_prefill_tokens: int = 0  # the prompt tokens the step computed
    num_decode_tokens: int = 0  # its one-token continuations of requests past their prompt
    host_s: float = 0.0  # its dispatch's host time (on a CPU device: its forward)
    output: StepOutput | None = None


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.executor = Executor.make(config)
        weakref.finalize(self, self.executor.shutdown)
        self.dead: BaseException | None = None  # a failed tensor-parallel step
        self.vocab_size = self.executor.vocab_size
        kv, num_lines = None, self.executor.startup["num_checkpoint_lines"]  # worker-sized
        caching = num_lines > 0  # 0: caching off, or mamba_cache_mode "none"
        if self.executor.num_kv_blocks:
            from vllm.engine.kv_cache_manager import KVCacheManager
            from vllm.engine.kv_prefix import PrefixKVCacheManager

            manager = PrefixKVCacheManager if caching else KVCacheManager
            kv = manager(self.executor.num_kv_blocks, config.block_size)
        self.prefix = None  # StatePrefixCache (HybridPrefixCache) with enable_prefix_caching
        self.prompt_checkpoints = None  # its prompt-checkpoint policy (prefix_policy.py)
        if config.enable_prefix_caching and not caching:
            logger.warning(
                "enable_prefix_caching with mamba_cache_mode='none': no Mamba state is "
                "cached (nothing written, nothing restored)"
            )
        if caching:
            from vllm.engine.kv_prefix import HybridPrefixCache
            from vllm.engine.prefix_cache import StatePrefixCache
            from vllm.engine.prefix_policy import PromptCheckpoints

            first = config.max_num_seqs + 1  # checkpoint lines follow the sequences' lines
            lines = range(first, first + num_lines)
            if kv is None:
                self.prefix = StatePrefixCache(lines, config.mamba_block_size)
            else:  # a hit also shares the attention KV blocks (kv_prefix.py)
                self.prefix = HybridPrefixCache(lines, config.mamba_block_size, kv)
            self.prompt_checkpoints = PromptCheckpoints(
                self.prefix,
                config.mamba_cache_mode,
                config.enable_mamba_shared_prefix_checkpoint,
                prompt_end=config.enable_mamba_prompt_end_checkpoint,
                align_cold=config.enable_mamba_align_cold_checkpoint,
            )
        # The request id goes with the prefix cache's calls when KV blocks are shared.
        self._kv_key = (lambda seq: (seq.request_id,)) if kv is not None else (lambda seq: ())
        self.step_times = StepTimes()  # fitted step times (late dispatch, the budget)
        self.step_budget = MixedStepBudget.of(config, self.step_times)  # None: ratio 0
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            kv,
            config.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            on_admit=self._restore if self.prefix is not None else None,
            cut_chunk=self.prompt_checkpoints.cut if self.prefix is not None else None,
            step_budget=self.step_budget,
        )
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self._in_flight: _Dispatched | None = None
        # The step read last and when its read returned (late_dispatch.py's estimate).
        self._last_read: _Dispatched | None = None
        self._read_done_at: float | None = None
        self.last_step = StepStats()
        # Outputs made outside a step's read (aborts, failed batches), sent with the next.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Seeded requests ended since the last dispatch: the worker drops their generators.
        self._forget: list[str] = []

    # -- requests ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the executor's workers (nothing to do on one rank). Idempotent."""
        self.executor.shutdown()

    def add_request(self, req: EngineCoreRequest) -> None:
        if self.dead is not None:
            raise RuntimeError(
                f"the engine has failed and takes no requests: {type(self.dead).__name__}: "
                f"{self.dead}"
            )
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        max_tokens = self.config.max_model_len - len(req.prompt_token_ids)
        if req.params.max_tokens is not None:
            max_tokens = min(max_tokens, req.params.max_tokens)
        seq = Sequence(req.request_id, req.prompt_token_ids, req.params, max_tokens=max_tokens)
        seq.eos_token_id = req.eos_token_id
        self.requests[req.request_id] = seq
        self.scheduler.add(seq)

    def abort_requests(self, request_ids) -> None:
        """End these requests now (unknown or finished ids are ignored) and free their
        slots; a token of theirs still in flight is dropped when read."""
        for rid in request_ids:
            seq = self.requests.get(rid)
            if seq is not None:
                self._finish(seq, "abort")

    def _restore(self, seq: Sequence) -> None:
        """Admission under prefix caching: restore the longest checkpointed prefix of the
        prompt into the sequence's slot (not for prompt logprobs, which need every row),
        then plan its prompt checkpoints."""
        # The prompt's block hashes, once for the lookup and the policy.
        hashes = hash_blocks(seq.prompt_token_ids, self.prefix.block_size)
        if seq.params.prompt_logprobs is None:
            key = self._kv_key(seq)
            n = self.prefix.restore(seq.prompt_token_ids, seq.slot, *key, hashes=hashes)
            seq.num_computed_tokens = seq.num_cached_tokens = n
        self.prompt_checkpoints.admit(seq, hashes)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if self.prefix is not None:  # its prompt-end checkpoint goes first from now on
            self.prompt_checkpoints.finishing(seq)
        if self.prefix is not None and reason in ("stop", "length") and seq.slot is not None:
            # Its line still holds its state: queue the copy before the slot is freed.
            self.prefix.checkpoint(
                seq.token_ids, seq.num_computed_tokens, seq.slot, *self._kv_key(seq)
            )
        self.scheduler.finish(seq, reason)
        if seq.params.seed is not None or seq.params.has_penalties:
            self._forget.append(seq.request_id)  # its generator, its token counts
        del self.requests[seq.request_id]

    def materialise(self, slots) -> None:
        """Whole states in these slots on every rank (``ModelRunner.materialise``): the
        prefix cache's and speculative decoding's hook under replayed decode."""
        self.executor.run("materialise", list(slots))

    @property
    def startup(self) -> dict:  # the workers' start-up times and sizes
        return self.executor.startup

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None or bool(self._pending_outputs)

    # -- steps ---------------------------------------------------------------------------

    def dispatch_deadline(self) -> float | None:
        """Until when the loop may wait for new requests before ``step`` (late_dispatch.py;
        None: step now)."""
        return late_dispatch.deadline(self)

    def step(self) -> list[EngineCoreOutput]:
        """Dispatch one step and read the one before it (under async scheduling; without
        it, read this one); the outputs of every request that got a token or finished."""
        t0 = time.perf_counter()
        index = self.prefix.index if self.prefix is not None else None
        looked = (index.queries, index.hits) if index is not None else (0, 0)
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        prefill = num_prompt_tokens(batch)
        dispatched = self._dispatch(batch) if batch.seqs else None
        t2 = time.perf_counter()
        if dispatched is not None:
            dispatched.num_prefill_tokens, dispatched.host_s = prefill, t2 - t1
            dispatched.num_decode_tokens = batch.total_tokens - prefill
        read = self._in_flight
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._in_flight is not None:
            outputs += self._read(self._in_flight)
        self._in_flight = dispatched
        if dispatched is not None and not self.config.async_scheduling:
            read = dispatched
            outputs += self._read(dispatched)
            self._in_flight = None
        t3 = time.perf_counter()
        read_prefill = read.num_prefill_tokens if read is not None else prefill
        out = read.output if read is not None else None
        if out is not None:
            self.step_times.observe_step(read, out)
        self.last_step = StepStats(
            schedule_s=t1 - t0,
            dispatch_s=t2 - t1,
            read_s=t3 - t2,
            num_prefill_tokens=prefill,
            num_decode_tokens=batch.total_tokens - prefill,
            waited_on_prefill=read_prefill > 0,
            device_s=out.device_s if out is not None else None,
            kernel_compiles=out.kernel_compiles if out is not None else 0,
            graph=out.graph if out is not None else False,
            prefill_capped=batch.prefill_capped,
        )
        if index is not None:
            self.last_step.prefix_cache_queries = index.queries - looked[0]
            self.last_step.prefix_cache_hits = index.hits - looked[1]
        return outputs

    def _dispatch(self, batch: ScheduledBatch) -> _Dispatched | None:
        """Hand the step to the executor; its tokens come back through the handle."""
        try:
            inputs, sampled, spans = build_step_inputs(batch, self._forget)
            self._forget = []
            if self.prefix is not None:
                inputs.state_copies = self.prefix.take_copies()
                if self.scheduler.kv is not None:
                    inputs.kv_copies = self.prefix.take_kv_copies()
            handle = self.executor.execute_model(inputs)
        except Exception as err:  # noqa: BLE001 - the batch's requests fail, the engine lives
            if self.prefix is not None:
                self.prefix.drop_all()  # the step's copies may not have run
            if self.executor.failed:
                self._die(err)
                return None
            logger.exception("a step's forward failed; failing its %d requests", len(batch))
            for seq in batch.seqs:
                self._fail(seq, f"the model step failed: {type(err).__name__}: {err}")
            return None
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n
        if self.prompt_checkpoints is not None:  # lines now on a checkpoint target
            self.prompt_checkpoints.after_dispatch(batch.seqs)
        positions = []
        for row, seq in enumerate(sampled):
            positions.append(len(seq.token_ids))
            seq.token_ids.append(PENDING_TOKEN)
            seq.pending_row = row
        self.num_steps += 1
        return _Dispatched(sampled, positions, spans, handle)

    def _die(self, err: BaseException) -> None:
        """A tensor-parallel step failed: the ranks are out of step, so every request
        fails with the error and the engine takes no more."""
        logger.error("the tensor-parallel engine failed: %s", err)
        self.dead = err
        message = f"the tensor-parallel engine failed: {type(err).__name__}: {err}"
        for seq in list(self.requests.values()):
            self._fail(seq, message)

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.is_finished:
            return
        self._finish(seq, "error")
        self._pending_outputs.append(
            EngineCoreOutput(seq.request_id, finish_reason="error", error=message)
        )

    def _read(self, step: _Dispatched) -> list[EngineCoreOutput]:
        """Read a dispatched step's output (waits for that step only, not for a step queued
        after it) and apply it."""
        out = step.output = step.handle.get()
        self._last_read, self._read_done_at = step, time.perf_counter()
        for row, message in out.errors.items():
            self._fail(step.seqs[row], f"sampling failed: {message}")
        # Those failures go out with this read, ahead of its tokens.
        outputs, self._pending_outputs = self._pending_outputs, []
        offset = 0
        for seq, _, count in step.prompt_spans:
            if seq.prompt_logprobs is not None:  # None: its first token was read already
                k = seq.params.prompt_logprobs
                lists = out.prompt_logprobs
                seq.prompt_logprobs += [lists.position(offset + j, k) for j in range(count)]
            offset += count
        lps = out.logprobs
        for row, (seq, pos) in enumerate(zip(step.seqs, step.positions, strict=True)):
            if seq.is_finished:
                continue  # ended (or aborted) before this token was read: dropped
            token = out.sampled_token_ids[row]
            seq.token_ids[pos] = token
            new = EngineCoreOutput(seq.request_id, [token])
            if lps is not None and seq.params.logprobs is not None:
                new.new_logprobs = [lps.position(row, seq.params.logprobs)]
            if pos == seq.num_prompt_tokens and seq.prompt_logprobs is not None:
                new.prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
            if pos == seq.num_prompt_tokens:
                new.num_cached_tokens = seq.num_cached_tokens
            reason, stop_token = self._check_stop(seq, pos)
            if reason is not None:
                del seq.token_ids[pos + 1 :]  # a later step's pending token
                self._finish(seq, reason)
                new.finish_reason, new.stop_reason = reason, stop_token
            outputs.append(new)
        return outputs

    @staticmethod
    def _check_stop(seq: Sequence, pos: int) -> tuple[str | None, int | None]:
        """Whether the token at ``pos`` (the last one read) ends the sequence, and why."""
        params = seq.params
        token = seq.token_ids[pos]
        if not params.ignore_eos and seq.eos_token_id is not None and token == seq.eos_token_id:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if pos + 1 - seq.num_prompt_tokens >= seq.max_tokens:
            return "length", None
        return None, None


def num_prompt_tokens(batch: ScheduledBatch) -> int:
    """The batch's prompt tokens (counted before the step computes them): the rows of
    sequences not yet past their prompt."""
    return sum(
        n
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        if seq.num_computed_tokens < seq.num_prompt_tokens
    )
